"""The router's global prefix index, fed by KV events (docs/architecture.md).

For every block hash it records which workers hold it in L1 (medium ``GPU``) or L2
(medium ``CPU``), as a bitmask of workers per tier (one lookup per block and tier answers
for every worker at once; the masks live in :class:`cpd.router.mask_table.MaskTable`, whose
lookups for a whole prompt are vectorised). The shared L3 store (medium ``L3``) is kept at the
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
from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np

from cpd.kv.events import (MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, STORED_TYPES, AllBlocksCleared, BlockRemoved,
                           BlockStored, BlockStoredHashes, IndexEventBatch, KVEventBatch)
from cpd.policy.routing import PrefixMatch
from cpd.router.l3_view import ChunkKey, L3View
from cpd.router.mask_table import PLANE_BITS, U64, MaskTable, as_u64

MAX_PENDING_WRITES = 65536  # block hashes being written through, all prefills together
PENDING_GRACE_S = 5.0  # a pending block is forgotten this long after its predicted visible time


_COL: dict[str | None, int] = {MEDIUM_L2: 1}  # medium -> mask column; any other (GPU, None, ...): L1 = 0


class _Tiers:
    """block hash → bitmask of the workers holding it, per tier (L1, L2): one
    :class:`MaskTable` (a row per hash: its L1 mask, its L2 mask) per plane of 63 workers
    (worker bit ``1 << i`` is local bit ``1 << (i % 63)`` of plane ``i // 63``)."""

    def __init__(self) -> None:
        self.planes: list[MaskTable] = []

    def plane(self, p: int) -> MaskTable:
        while len(self.planes) <= p:
            self.planes.append(MaskTable())
        return self.planes[p]

    def of(self, bit: int) -> tuple[MaskTable, int]:
        """(the table of worker bit ``bit``'s plane, its local bit there)."""
        p, local = _plane_bit(bit)
        return self.plane(p), local

    def add(self, col: int, bit: int, hashes: Iterable[int]) -> None:
        table, local = self.of(bit)
        table.add(col, local, hashes)

    def remove(self, col: int, bit: int, hashes: Iterable[int]) -> None:
        table, local = self.of(bit)
        table.remove(col, local, hashes)

    def clear_worker(self, bit: int) -> None:
        p, local = _plane_bit(bit)
        if p < len(self.planes):
            self.planes[p].clear_bit(local)

    def size(self, col: int) -> int:
        return sum(t.num_pairs[col] for t in self.planes)


def _plane_bit(bit: int) -> tuple[int, int]:
    """(plane, local bit) of worker bit ``bit``."""
    p, i = divmod(bit.bit_length() - 1, PLANE_BITS)
    return p, 1 << i


class PrefixIndex:
    """block hash → holders per tier. L1/L2 are per worker; L3 is global."""

    def __init__(self, l3_chunk_blocks: int | None = None) -> None:
        self._lock = threading.Lock()
        self._bits: dict[str, int] = {}  # worker id -> its bit
        self._free_bits: list[int] = []
        self._next_bit = 1
        self._tiers = _Tiers()
        self._l3 = L3View(l3_chunk_blocks)
        self._last_seq: dict[str, int] = {}
        self.num_gaps = 0
        self._pending: OrderedDict[int, float] = OrderedDict()  # hash -> predicted visible (monotonic s)

    # --- updates -----------------------------------------------------------------
    def apply_batch(self, worker_id: str, seq: int, batch: KVEventBatch | IndexEventBatch) -> bool:
        """Apply one batch from ``worker_id`` (its ``BlockStored`` events decoded in full, or as
        :class:`BlockStoredHashes`: the index reads their hashes and medium only). A batch at or
        below the last applied sequence number is older than the L1/L2 snapshot that set it
        (batches arrive in order, once): its L1/L2 events are in that snapshot and are skipped, but
        its L3 events are not (the snapshot holds no L3) and are applied. Returns False if a gap
        was detected (``seq`` > last+1); the batch is still applied and the caller should
        resynchronise from a snapshot."""
        with self._lock:
            last = self._last_seq.get(worker_id)
            if last is not None and seq <= last:
                for ev in batch.events:
                    if getattr(ev, "medium", None) == MEDIUM_L3:
                        self._apply(worker_id, ev)
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
        table: MaskTable | None = None
        local = 0
        run: tuple[bool, int] | None = None  # (stored?, tier column) of the pending run of L1/L2 events
        keys: list[int] = []
        for ev in events:
            t = type(ev)
            stored = t is BlockStoredHashes or t is BlockStored
            if (stored or t is BlockRemoved) and ev.medium != MEDIUM_L3:
                if table is None:
                    table, local = self._tiers.of(self._bit(worker_id))
                kind = (stored, _COL.get(ev.medium, 0))
                if kind != run:
                    self._apply_run(table, local, run, keys)
                    run, keys = kind, []
                keys.extend(ev.block_hashes)
            elif stored:  # L3: a chunk became visible (as _apply; L1/L2 masks untouched)
                self._l3_stored(ev.block_hashes)
            else:
                self._apply_run(table, local, run, keys)
                run, keys = None, []
                self._apply(worker_id, ev)
        self._apply_run(table, local, run, keys)

    @staticmethod
    def _apply_run(table: MaskTable | None, local: int, run: tuple[bool, int] | None, keys: list[int]) -> None:
        """Consecutive L1/L2 events of one kind (stored or removed) and tier, as one table update:
        setting (clearing) a bit key by key or all at once leaves the same masks."""
        if run is None or table is None or not keys:
            return
        if run[0]:
            table.add(run[1], local, keys)
        else:
            table.remove(run[1], local, keys)

    def _l3_stored(self, hashes: list[int]) -> None:
        """A ``BlockStored(L3)``: the chunk joins the L3 view; its blocks are no longer pending."""
        self._l3.stored(hashes)
        pending = self._pending
        if pending:
            for h in hashes:  # visible now: no longer pending
                pending.pop(h, None)

    def _apply(self, worker_id: str, ev) -> None:
        if isinstance(ev, STORED_TYPES):
            if ev.medium == MEDIUM_L3:
                self._l3_stored(ev.block_hashes)
            else:
                self._tiers.add(_COL.get(ev.medium, 0), self._bit(worker_id), ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            if ev.medium == MEDIUM_L3:
                self._l3.removed(ev.block_hashes)
            else:
                self._tiers.remove(_COL.get(ev.medium, 0), self._bit(worker_id), ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            self._tiers.clear_worker(self._bit(worker_id))

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
            self._tiers.clear_worker(bit)
            self._tiers.add(0, bit, l1)
            self._tiers.add(1, bit, l2)
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
                self._tiers.clear_worker(bit)
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
        One walk per plane of workers: :meth:`MaskTable.runs` (C) where it answers, else
        :func:`_walk`."""
        groups: dict[int, int] = {}  # plane -> its workers' local bits
        for bit in self._bits.values():
            p, local = _plane_bit(bit)
            groups[p] = groups.get(p, 0) | local
        q: _Query | None = None
        ends: dict[int, tuple[int, int]] = {}
        for p, group in groups.items():
            table = self._tiers.plane(p)
            runs = table.runs(block_hashes, group)
            if runs is None:
                if q is None:
                    q = _Query(block_hashes)
                runs = _walk(table, q, group)
            for local, e in runs.items():
                ends[local << (PLANE_BITS * p)] = e
        return {w: ends[bit] for w, bit in self._bits.items() if ends.get(bit, (0, 0))[1]}

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"L1": self._tiers.size(0), "L2": self._tiers.size(1),
                    "L3": self._l3.num_blocks()}

    def l3_chunks(self) -> list[ChunkKey]:
        """The L3 chunks the index believes visible (for tests and debugging)."""
        with self._lock:
            return self._l3.keys()


class _Query:
    """A prompt's block hashes, turned into a uint64 array lazily, as far as a walk needs them
    (a cold prompt's walk stops at its first blocks); up to :data:`_FIRST_CHUNK` blocks are
    looked up one by one."""

    def __init__(self, block_hashes: Sequence[int]) -> None:
        self.hashes = block_hashes
        self.n = len(block_hashes)
        self._arr: U64 | None = as_u64(block_hashes) if isinstance(block_hashes, np.ndarray) else None
        self._done = self.n if self._arr is not None else 0
        self._odd = isinstance(block_hashes, np.ndarray) and self._arr is None  # a hash outside [0, 2**64): one by one

    def first_masks(self, table: MaskTable) -> int:
        """The OR of the table's L1 and L2 masks of block 0."""
        m1, m2 = table.get(self.hashes[0])
        return m1 | m2

    def masks(self, table: MaskTable, s: int, e: int) -> U64:
        """The table's (L1, L2) masks of blocks ``s .. e-1``, shape ``(e - s, 2)``."""
        if not len(table):
            return np.zeros((e - s, 2), np.uint64)
        if e <= _FIRST_CHUNK or self._odd:
            return np.array([table.get(h) for h in self.hashes[s:e]], np.uint64).reshape(e - s, 2)
        if e > self._done:
            upto = min(self.n, max(e, _CHUNK_GROWTH * self._done))  # a whole round at least
            part = as_u64(self.hashes[self._done:upto])
            if part is None:
                self._odd = True
            else:
                self._arr = part if self._arr is None else np.concatenate((self._arr, part))
                self._done = upto
        if e <= self._done and self._arr is not None:
            return table.lookup(self._arr[s:e])
        return np.array([table.get(h) for h in self.hashes[s:e]], np.uint64).reshape(e - s, 2)


# A walk looks blocks up in rounds: the first _FIRST_CHUNK one by one (a short shared head, e.g.
# a system prompt, costs no numpy call), then _SECOND_CHUNK at once, then _CHUNK_GROWTH x more
# each round. A round costs ~80 numpy calls, each tens of microseconds right after hashing a
# long prompt has evicted the caches, which is more than gathering a few thousand more rows:
# the default second round is the rest of the prompt.
_FIRST_CHUNK = 32
_SECOND_CHUNK = 1 << 40
_CHUNK_GROWTH = 4


def _walk(table: MaskTable, q: _Query, group: int) -> dict[int, tuple[int, int]]:
    """For each local worker bit in ``group``: (end of its run of consecutive blocks from 0
    held in L1, end of the run continuing it in L2). Both tiers' masks are looked up together,
    in rounds of growing size, until no bit is left in either run. In a round, the running AND
    of the L1 masks only loses bits; a bit lost at block ``j`` ends its L1 run at ``j`` and
    starts its L2 run there (a running AND of the L2 masks from ``j``)."""
    end1: dict[int, int] = {}
    end2: dict[int, int] = {}
    if q.n and not (q.first_masks(table) & group):  # no run at all (a cold prompt): one probe
        return {bit: (0, 0) for bit in _bits_of(group)}
    s, step, cur1, cur2 = 0, _FIRST_CHUNK, group, 0  # cur1: in their L1 run; cur2: in their L2 run
    while (cur1 or cur2) and s < q.n:
        e = min(q.n, s + max(1, step))
        m = q.masks(table, s, e)
        starts = [(0, cur2)] if cur2 else []  # (offset in this round, bits starting their L2 walk there)
        if cur1:
            acc = np.bitwise_and.accumulate(m[:, 0]) & np.uint64(cur1)
            for k, gone in _losses(acc, cur1):
                for bit in _bits_of(gone):
                    end1[bit] = s + k
                starts.append((k, gone))
            cur1 = int(acc[-1])
        cur2 = 0
        for k0, g in starts:
            acc = np.bitwise_and.accumulate(m[k0:, 1]) & np.uint64(g)
            for k, gone in _losses(acc, g):
                for bit in _bits_of(gone):
                    end2[bit] = s + k0 + k
            cur2 |= int(acc[-1])
        s, step = e, _SECOND_CHUNK if s == 0 else _CHUNK_GROWTH * step
    for bit in _bits_of(cur1):  # held to the end of the prompt
        end1[bit] = end2[bit] = s
    for bit in _bits_of(cur2):
        end2[bit] = s
    return {bit: (end1[bit], end2[bit]) for bit in end1}


def _losses(acc: U64, cur: int) -> list[tuple[int, int]]:
    """(k, bits lost at k) for a running AND ``acc`` (``acc[k]`` = ``cur`` AND the masks of
    blocks 0 .. k of the round)."""
    out = []
    prev = cur
    ks = (acc[1:] != acc[:-1]).nonzero()[0] + 1
    for k in ([0] if int(acc[0]) != cur else []) + ks.tolist():
        now = int(acc[k])
        out.append((k, prev & ~now))
        prev = now
    return out


def _bits_of(mask: int) -> list[int]:
    out = []
    while mask:
        bit = mask & -mask
        out.append(bit)
        mask ^= bit
    return out
