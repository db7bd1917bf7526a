"""The router's global prefix index, fed by KV events (DESIGN §3, §4).

For every block hash it records which workers hold it in L1 (medium ``GPU``) or L2
(medium ``CPU``), and whether the shared L3 store holds it visibly (medium ``L3``).
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


class PrefixIndex:
    """block hash → holders per tier. L1/L2 are per worker; L3 is global."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local: dict[str, dict[str, set[int]]] = defaultdict(lambda: {MEDIUM_L1: set(), MEDIUM_L2: set()})
        self._l3: set[int] = set()
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
            self._holder(worker_id, ev.medium).update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            self._holder(worker_id, ev.medium).difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            self._local[worker_id][MEDIUM_L1].clear()
            self._local[worker_id][MEDIUM_L2].clear()

    def _holder(self, worker_id: str, medium: str | None) -> set[int]:
        if medium == MEDIUM_L3:
            return self._l3
        return self._local[worker_id][medium if medium in (MEDIUM_L1, MEDIUM_L2) else MEDIUM_L1]

    def replace_worker(self, worker_id: str, l1: Iterable[int], l2: Iterable[int], seq: int | None = None) -> None:
        """Resynchronise one worker's L1/L2 entries from a snapshot."""
        with self._lock:
            self._local[worker_id] = {MEDIUM_L1: set(l1), MEDIUM_L2: set(l2)}
            if seq is not None:
                self._last_seq[worker_id] = seq

    def replace_l3(self, hashes: Iterable[int]) -> None:
        with self._lock:
            self._l3 = set(hashes)

    def drop_worker(self, worker_id: str) -> None:
        """Forget a dead worker's L1/L2 blocks (its L3 writes stay: they are shared)."""
        with self._lock:
            self._local.pop(worker_id, None)
            self._last_seq.pop(worker_id, None)

    def discard_l3(self, hashes: Iterable[int]) -> None:
        """Correct the index after a worker found L3 blocks missing (stale index)."""
        with self._lock:
            self._l3.difference_update(hashes)

    # --- queries -----------------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Leading-run matches of ``block_hashes`` per worker and tier (for the policy)."""
        with self._lock:
            l1 = {w: _leading(block_hashes, t[MEDIUM_L1]) for w, t in self._local.items()}
            l2 = {w: _leading(block_hashes, t[MEDIUM_L2]) for w, t in self._local.items()}
            l3 = _leading(block_hashes, self._l3)
        return PrefixMatch(l1={w: n for w, n in l1.items() if n},
                           l2={w: n for w, n in l2.items() if n}, l3=l3)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"L1": sum(len(t[MEDIUM_L1]) for t in self._local.values()),
                    "L2": sum(len(t[MEDIUM_L2]) for t in self._local.values()), "L3": len(self._l3)}


def _leading(block_hashes: Sequence[int], held: set[int]) -> int:
    n = 0
    for h in block_hashes:
        if h not in held:
            break
        n += 1
    return n
