"""The router's global prefix index, fed by KV events (docs/architecture.md).

For every block hash it records which workers hold it in L1 (medium ``GPU``) or L2
(medium ``CPU``), as a bitmask of workers per tier (one dict lookup per block and tier
answers for every worker at once). The shared L3 store (medium ``L3``) is kept at the
store's own granularity, chunks, by :class:`cpd.router.l3_view.L3View` (see there for how
it converges: events, worker observations, re-announcements, store snapshots).
Only blocks announced by ``BlockStored`` count; ``BlockRemoved`` and
``AllBlocksCleared`` retract them. Each publisher's batches carry a sequence number;
:meth:`PrefixIndex.apply_batch` reports a gap so the caller can resynchronise the
publisher from a snapshot (:meth:`PrefixIndex.replace_worker`).

Matching follows the engine's load order exactly (``cpd.engine.engine``): a worker's
leading run in L1, then the run continuing in its L2 from where L1 stopped, then the run
continuing in L3 from where L2 stopped. So a worker with the head in L1 and the tail in L2
is credited with both, and so are L2 + L3 and L1 + L3.

Read-after-write (issue 11 §5): the dispatcher announces the blocks a prefill is writing
through to L3 right now (:meth:`PrefixIndex.add_pending_writes`, with the time they are predicted
visible); :meth:`PrefixIndex.match` reports the run of such blocks continuing the visible L3 run
(``PrefixMatch.l3_pending`` / ``l3_pending_ready_s``). Bounded: at most
:data:`MAX_PENDING_WRITES` hashes, each forgotten :data:`PENDING_GRACE_S` after its predicted
time, when it shows up in L3, or when its prefill fails.

Thread-safety: all public methods take one lock; ``match`` is O(prefix length).
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from itertools import accumulate, islice, repeat, takewhile
from operator import and_
from typing import Iterable, Sequence

from cpd.kv.events import (MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, AllBlocksCleared, BlockRemoved, BlockStored,
                           KVEventBatch)
from cpd.policy.routing import PrefixMatch
from cpd.router.l3_view import ChunkKey, L3View

MAX_PENDING_WRITES = 65536  # block hashes being written through, all prefills together
PENDING_GRACE_S = 5.0  # a pending block is forgotten this long after its predicted visible time


class _TierMasks:
    """block hash → bitmask of the workers holding it in one tier, plus each worker's set."""

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self.held: dict[int, set[int]] = {}  # worker bit -> hashes

    def add(self, bit: int, hashes: Iterable[int]) -> None:
        held = self.held.get(bit)
        if held is None:
            held = self.held[bit] = set()
        masks = self.masks
        for h in hashes:
            if h not in held:
                held.add(h)
                masks[h] = masks.get(h, 0) | bit

    def remove(self, bit: int, hashes: Iterable[int]) -> None:
        held = self.held.get(bit)
        if not held:
            return
        for h in hashes:
            if h in held:
                held.discard(h)
                self._clear(h, bit)

    def clear_worker(self, bit: int) -> None:
        for h in self.held.pop(bit, ()):
            self._clear(h, bit)

    def _clear(self, h: int, bit: int) -> None:
        m = self.masks.get(h, 0) & ~bit
        if m:
            self.masks[h] = m
        else:
            self.masks.pop(h, None)

    def size(self) -> int:
        return sum(len(s) for s in self.held.values())


class PrefixIndex:
    """block hash → holders per tier. L1/L2 are per worker; L3 is global."""

    def __init__(self, l3_chunk_blocks: int | None = None) -> None:
        self._lock = threading.Lock()
        self._bits: dict[str, int] = {}  # worker id -> its bit
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._tiers = {MEDIUM_L1: _TierMasks(), MEDIUM_L2: _TierMasks()}
        self._l3 = L3View(l3_chunk_blocks)
        self._last_seq: dict[str, int] = {}
        self.num_gaps = 0
        self._pending: OrderedDict[int, float] = OrderedDict()  # hash -> predicted visible (monotonic s)

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
            self._apply_events(worker_id, batch.events)
        ok = last is None or seq == last + 1
        if not ok:
            self.num_gaps += 1
        return ok

    def _apply_events(self, worker_id: str, events: Iterable) -> None:
        """:meth:`_apply` each event in order; L1/L2 ``BlockStored``/``BlockRemoved`` (nearly all
        events) inline, with the worker's bit looked up once (still at the first event that
        needs it, so bits are assigned in the same order)."""
        tiers = self._tiers
        l1 = tiers[MEDIUM_L1]
        bit = 0
        for ev in events:
            t = type(ev)
            if (t is BlockStored or t is BlockRemoved) and ev.medium != MEDIUM_L3:
                if not bit:
                    bit = self._bit(worker_id)
                tier = tiers.get(ev.medium, l1)
                if t is BlockStored:
                    tier.add(bit, ev.block_hashes)
                else:
                    tier.remove(bit, ev.block_hashes)
            else:
                self._apply(worker_id, ev)

    def _apply(self, worker_id: str, ev) -> None:
        if isinstance(ev, BlockStored):
            if ev.medium == MEDIUM_L3:
                self._l3.stored(ev.block_hashes)
                for h in ev.block_hashes:  # visible now: no longer pending
                    self._pending.pop(h, None)
            else:
                self._tier(ev.medium).add(self._bit(worker_id), ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            if ev.medium == MEDIUM_L3:
                self._l3.removed(ev.block_hashes)
            else:
                self._tier(ev.medium).remove(self._bit(worker_id), ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            bit = self._bit(worker_id)
            for t in self._tiers.values():
                t.clear_worker(bit)

    def _tier(self, medium: str | None) -> _TierMasks:
        return self._tiers[medium if medium in (MEDIUM_L1, MEDIUM_L2) else MEDIUM_L1]

    def _bit(self, worker_id: str) -> int:
        bit = self._bits.get(worker_id)
        if bit is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = self._next_bit, self._next_bit << 1
            self._bits[worker_id] = bit
        return bit

    def replace_worker(self, worker_id: str, l1: Iterable[int], l2: Iterable[int], seq: int | None = None) -> None:
        """Resynchronise one worker's L1/L2 entries from a snapshot."""
        with self._lock:
            bit = self._bit(worker_id)
            for t, hs in ((self._tiers[MEDIUM_L1], l1), (self._tiers[MEDIUM_L2], l2)):
                t.clear_worker(bit)
                t.add(bit, hs)
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
            bit = self._bits.pop(worker_id, None)
            if bit is not None:
                for t in self._tiers.values():
                    t.clear_worker(bit)
                self._free_bits.append(bit)
            self._last_seq.pop(worker_id, None)

    def observe_l3(self, block_hashes: Sequence[int], present: Iterable[ChunkKey],
                   gone: Iterable[ChunkKey] = (), since: float | None = None) -> None:
        """Apply what a worker found in the store (see :meth:`L3View.observe`); ``since`` is a
        ``time.monotonic()`` before the probe (removals spare chunks learned later)."""
        with self._lock:
            self._l3.observe(block_hashes, present, gone, since)

    def add_pending_writes(self, block_hashes: Iterable[int], ready_at_s: float) -> None:
        """Blocks a prefill is writing through to L3 now, predicted visible at ``ready_at_s``
        (``time.monotonic()`` clock). The oldest entries go beyond :data:`MAX_PENDING_WRITES`."""
        with self._lock:
            for h in block_hashes:
                self._pending[h] = ready_at_s
                self._pending.move_to_end(h)
            while len(self._pending) > MAX_PENDING_WRITES:
                self._pending.popitem(last=False)

    def drop_pending_writes(self, block_hashes: Iterable[int]) -> None:
        """Forget pending blocks (their prefill failed: they will not show up)."""
        with self._lock:
            for h in block_hashes:
                self._pending.pop(h, None)

    def num_pending_writes(self) -> int:
        with self._lock:
            return len(self._pending)

    # --- queries -----------------------------------------------------------------
    def match(self, block_hashes: Sequence[int], l3_max_blocks: int | None = None,
              now_s: float | None = None) -> PrefixMatch:
        """Per worker, the blocks the engine would load from each tier, in its order
        L1 → L2 → L3 (see :class:`cpd.policy.routing.PrefixMatch`).
        ``l3_max_blocks``: the most leading blocks a worker would load (the engine always
        computes the last prompt token); the L3 match is what the store can serve up to that
        many blocks, which at chunk granularity can be less than ``min(match, cap)``.
        ``now_s``: ``time.monotonic()`` (default: now), for the pending writes' ready times."""
        now = time.monotonic() if now_s is None else now_s
        with self._lock:
            ends = self._local_runs(block_hashes)
            l3 = self._l3.leading(block_hashes, l3_max_blocks)
            l3_after: dict[str, int] = {}
            by_start: dict[int, int] = {0: l3}
            for w, (_, b) in ends.items():
                start = b if l3_max_blocks is None else min(b, max(0, l3_max_blocks))
                if start not in by_start:
                    by_start[start] = self._l3.leading(block_hashes, l3_max_blocks, start=start)
                if by_start[start] > start:
                    l3_after[w] = by_start[start]
            pending, ready_s = self._pending_run(block_hashes, l3, l3_max_blocks, now)
        return PrefixMatch(l1={w: a for w, (a, _) in ends.items() if a},
                           l2={w: b for w, (a, b) in ends.items() if b > a}, l3=l3, l3_after=l3_after,
                           l3_pending=pending, l3_pending_ready_s=ready_s)

    def _pending_run(self, block_hashes: Sequence[int], start: int, cap: int | None,
                     now: float) -> tuple[int, float]:
        """End of the run of pending blocks from ``start`` (0 if none) and the seconds until the
        last of them is predicted visible. Expired entries are dropped first (the dict is in
        insertion order, which is close to ready-time order)."""
        p = self._pending
        while p and next(iter(p.values())) + PENDING_GRACE_S < now:
            p.popitem(last=False)
        end = len(block_hashes) if cap is None else min(len(block_hashes), max(0, cap))
        i, ready = start, now
        while i < end:
            t = p.get(block_hashes[i])
            if t is None:
                break
            ready = max(ready, t)
            i += 1
        return (i, ready - now) if i > start else (0, 0.0)

    def _local_runs(self, block_hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """worker id → (end of its L1 run from block 0, end of the L2 run continuing it).
        The runs are walked in C (``map``/``accumulate`` over worker bitmasks, stopping when
        no worker is left); the per-worker ends are then found by bisection."""
        everyone = 0
        for bit in self._bits.values():
            everyone |= bit
        end1 = _run_ends(self._tiers[MEDIUM_L1].masks, block_hashes, 0, everyone)
        by_start: dict[int, int] = {}
        for bit, a in end1.items():
            by_start[a] = by_start.get(a, 0) | bit
        l2 = self._tiers[MEDIUM_L2].masks
        end2: dict[int, int] = {}
        for a, group in by_start.items():
            for bit, b in _run_ends(l2, block_hashes, a, group).items():
                end2[bit] = b
        return {w: (end1.get(bit, 0), end2[bit]) for w, bit in self._bits.items() if end2.get(bit, 0)}

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"L1": self._tiers[MEDIUM_L1].size(), "L2": self._tiers[MEDIUM_L2].size(),
                    "L3": self._l3.num_blocks()}

    def l3_chunks(self) -> list[ChunkKey]:
        """The L3 chunks the index believes visible (for tests and debugging)."""
        with self._lock:
            return self._l3.keys()


def _run_ends(masks: dict[int, int], block_hashes: Sequence[int], start: int, group: int) -> dict[int, int]:
    """For each worker bit in ``group``: the end of its run of consecutive blocks from
    ``start`` whose tier mask holds the bit."""
    acc = list(takewhile(bool, accumulate(map(masks.get, islice(block_hashes, start, None), repeat(0)), and_,
                                          initial=group)))
    # acc[k] = workers holding blocks start .. start+k-1 (acc[0] = group); it only loses bits
    ends: dict[int, int] = {}
    lo, cur = 0, group
    while cur:
        k = bisect_left(acc, True, lo, key=lambda x: x != cur)  # first k with acc[k] != cur
        nxt = acc[k] if k < len(acc) else 0
        gone = cur & ~nxt
        while gone:
            bit = gone & -gone
            ends[bit] = start + k - 1
            gone ^= bit
        lo, cur = k, nxt
    return ends
