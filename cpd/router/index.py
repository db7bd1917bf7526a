"""The router's global prefix index, fed by KV events (DESIGN §3, §4).

For every block hash it records which workers hold it in L1 (medium ``GPU``) or L2
(medium ``CPU``). The shared L3 store (medium ``L3``) is kept at the store's own
granularity, chunks, by :class:`cpd.router.l3_view.L3View` (see there for how it converges:
events, worker observations, re-announcements, store snapshots).
Only blocks announced by ``BlockStored`` count; ``BlockRemoved`` and
``AllBlocksCleared`` retract them. Each publisher's batches carry a sequence number;
:meth:`PrefixIndex.apply_batch` reports a gap so the caller can resynchronise the
publisher from a snapshot (:meth:`PrefixIndex.replace_worker`).

Thread-safety: all public methods take one lock; ``match`` is O(prefix length).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Iterable, Sequence

from cpd.kv.events import (MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, AllBlocksCleared, BlockRemoved, BlockStored,
                           KVEventBatch)
from cpd.policy.routing import PrefixMatch
from cpd.router.l3_view import ChunkKey, L3View


class PrefixIndex:
    """block hash → holders per tier. L1/L2 are per worker; L3 is global."""

    def __init__(self, l3_chunk_blocks: int | None = None) -> None:
        self._lock = threading.Lock()
        self._local: dict[str, dict[str, set[int]]] = defaultdict(lambda: {MEDIUM_L1: set(), MEDIUM_L2: set()})
        self._l3 = L3View(l3_chunk_blocks)
        self._last_seq: dict[str, int] = {}
        self.num_gaps = 0

    # --- updates -----------------------------------------------------------------
    def apply_batch(self, worker_id: str, seq: int, batch: KVEventBatch) -> bool:
        """Apply one batch from ``worker_id``. Batches at or below the last applied
        sequence number (e.g. older than a snapshot) are ignored. Returns False if a gap
        was detected (``seq`` > last+1); the batch is still applied and the caller should
        resynchronise from a snapshot."""
        with self._lock:
            last = self._last_seq.get(worker_id)
            if last is not None and seq <= last:
                return True
            self._last_seq[worker_id] = seq
            for ev in batch.events:
                self._apply(worker_id, ev)
        ok = last is None or seq == last + 1
        if not ok:
            self.num_gaps += 1
        return ok

    def _apply(self, worker_id: str, ev) -> None:
        if isinstance(ev, BlockStored):
            if ev.medium == MEDIUM_L3:
                self._l3.stored(ev.block_hashes)
            else:
                self._holder(worker_id, ev.medium).update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            if ev.medium == MEDIUM_L3:
                self._l3.removed(ev.block_hashes)
            else:
                self._holder(worker_id, ev.medium).difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            self._local[worker_id][MEDIUM_L1].clear()
            self._local[worker_id][MEDIUM_L2].clear()

    def _holder(self, worker_id: str, medium: str | None) -> set[int]:
        return self._local[worker_id][medium if medium in (MEDIUM_L1, MEDIUM_L2) else MEDIUM_L1]

    def replace_worker(self, worker_id: str, l1: Iterable[int], l2: Iterable[int], seq: int | None = None) -> None:
        """Resynchronise one worker's L1/L2 entries from a snapshot."""
        with self._lock:
            self._local[worker_id] = {MEDIUM_L1: set(l1), MEDIUM_L2: set(l2)}
            if seq is not None:
                self._last_seq[worker_id] = seq

    def begin_l3_resync(self) -> None:
        """A store listing is being fetched: journal L3 updates until it arrives."""
        with self._lock:
            self._l3.begin_resync()

    def finish_l3_resync(self, keys: Iterable[ChunkKey]) -> None:
        """Rebuild the L3 view from a store listing (chunk keys), then replay the journal."""
        with self._lock:
            self._l3.finish_resync(keys)

    def abort_l3_resync(self) -> None:
        with self._lock:
            self._l3.abort_resync()

    def drop_worker(self, worker_id: str) -> None:
        """Forget a dead worker's L1/L2 blocks (its L3 writes stay: they are shared)."""
        with self._lock:
            self._local.pop(worker_id, None)
            self._last_seq.pop(worker_id, None)

    def observe_l3(self, block_hashes: Sequence[int], present: Iterable[ChunkKey],
                   gone: Iterable[ChunkKey] = (), since: float | None = None) -> None:
        """Apply what a worker found in the store (see :meth:`L3View.observe`); ``since`` is a
        ``time.monotonic()`` before the probe (removals spare chunks learned later)."""
        with self._lock:
            self._l3.observe(block_hashes, present, gone, since)

    # --- queries -----------------------------------------------------------------
    def match(self, block_hashes: Sequence[int], l3_max_blocks: int | None = None) -> PrefixMatch:
        """Leading-run matches of ``block_hashes`` per worker and tier (for the policy).
        ``l3_max_blocks``: the most leading blocks a worker would load (the engine always
        computes the last prompt token); the L3 match is what the store can serve for that
        many blocks, which at chunk granularity can be less than ``min(match, cap)``."""
        with self._lock:
            l1 = {w: _leading(block_hashes, t[MEDIUM_L1]) for w, t in self._local.items()}
            l2 = {w: _leading(block_hashes, t[MEDIUM_L2]) for w, t in self._local.items()}
            l3 = self._l3.leading(block_hashes, l3_max_blocks)
        return PrefixMatch(l1={w: n for w, n in l1.items() if n},
                           l2={w: n for w, n in l2.items() if n}, l3=l3)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"L1": sum(len(t[MEDIUM_L1]) for t in self._local.values()),
                    "L2": sum(len(t[MEDIUM_L2]) for t in self._local.values()), "L3": self._l3.num_blocks()}

    def l3_chunks(self) -> list[ChunkKey]:
        """The L3 chunks the index believes visible (for tests and debugging)."""
        with self._lock:
            return self._l3.keys()


def _leading(block_hashes: Sequence[int], held: set[int]) -> int:
    n = 0
    for h in block_hashes:
        if h not in held:
            break
        n += 1
    return n
