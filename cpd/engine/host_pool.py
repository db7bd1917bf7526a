"""L2 host pool: a per-worker, preallocated host-memory cache of full KV blocks.

L1 (:class:`cpd.engine.kv_pool.KVPool`) spills a cached block here before it reuses
the block's device memory; a request whose prefix misses L1 but hits here gets the
blocks copied back (promoted) into L1. Entries are keyed by chained block hash
(``cpd.kv.block_hash``) and evicted in LRU order. The pool is *inclusive*: a
promoted block stays here too.

Each slot holds one block in the contract layout
``[num_layers, 2, block_size, num_kv_heads, head_dim]`` (``cpd.engine.connector``).
Events: ``BlockStored`` / ``BlockRemoved`` with ``medium=MEDIUM_L2`` ("CPU"): one per block, or,
within :meth:`HostPool.batched_events` (the L1 pool's evictions of one allocation), the net effect
of the whole batch at its end: one ``BlockRemoved`` of the blocks held before and gone after, and
the blocks new after as ``BlockStored`` runs (:func:`cpd.kv.events.stored_runs`). A block stored and
evicted again within the batch is not announced at all, one evicted and stored again neither: a
subscriber that applies the events in order ends in the same state as with one event per block
(the publisher flushes after the engine step, and snapshots are taken between steps).
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from cpd.engine.connector import EventSink
from cpd.engine.kv_arrays import KVArrays, TorchKVArrays
from cpd.kv.events import MEDIUM_L2, BlockRemoved, BlockStored, stored_runs

if TYPE_CHECKING:
    import torch


class NetBlockEvents:
    """The net effect of a sequence of single-block stores and removals (pure bookkeeping): what
    was removed and not stored again, what was stored and not removed again, in order."""

    def __init__(self) -> None:
        self.stored: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, tokens)
        self.removed: dict[int, None] = {}

    def store(self, block_hash: int, parent_hash: int | None, token_ids: list[int]) -> None:
        if block_hash in self.removed:  # removed earlier in the batch: held before and after
            del self.removed[block_hash]
        else:
            self.stored[block_hash] = (parent_hash, token_ids)

    def remove(self, block_hash: int) -> None:
        if block_hash in self.stored:  # stored in this batch: neither held before nor after
            del self.stored[block_hash]
        else:
            self.removed[block_hash] = None

    def events(self, block_size: int, medium: str) -> list:
        """The batch's events: one ``BlockRemoved`` (if any), then the ``BlockStored`` runs."""
        out: list = [BlockRemoved(block_hashes=list(self.removed), medium=medium)] if self.removed else []
        return out + stored_runs(((h, p, t) for h, (p, t) in self.stored.items()), block_size, medium)


class HostPool:
    """LRU block cache in one preallocated host tensor.

    Args:
        capacity_bytes: host memory budget in bytes; ``num_slots = capacity_bytes // block_bytes``.
            0 (or less than one block) disables the pool (every call is a no-op / miss).
        block_shape: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``.
        dtype: KV dtype (torch arrays, when ``arrays`` is None).
        arrays: the kind of KV array (:mod:`cpd.engine.kv_arrays`; numpy for a modeled engine).
        event_sink: receives L2 events (optional).
        pin_memory: pin the host tensor (faster device copies; only when CUDA is available).
    """

    def __init__(self, capacity_bytes: int, block_shape: Sequence[int], dtype: torch.dtype | None = None,
                 event_sink: EventSink | None = None, pin_memory: bool = False, arrays: KVArrays | None = None):
        self.block_shape = tuple(int(x) for x in block_shape)
        self.arrays = arrays or TorchKVArrays(dtype)
        self.dtype = getattr(self.arrays, "dtype", dtype)
        numel = 1
        for x in self.block_shape:
            numel *= x
        self.block_bytes = numel * self.arrays.element_size
        self.num_slots = max(0, int(capacity_bytes) // self.block_bytes) if capacity_bytes > 0 else 0
        self.data = self.arrays.empty((self.num_slots, *self.block_shape), pin_memory=pin_memory)
        self._sink = event_sink
        self._lru: OrderedDict[int, int] = OrderedDict()  # hash -> slot, LRU first
        self._free: list[int] = list(range(self.num_slots - 1, -1, -1))
        self.num_stores = 0
        self.num_evictions = 0
        self.num_hits = 0
        self._batch: NetBlockEvents | None = None

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def _emit(self, ev) -> None:
        if self._sink is not None:
            self._sink(ev)

    @contextmanager
    def batched_events(self) -> Iterator[None]:
        """Hold this pool's events while the block runs and emit their net effect at its end (the
        module docstring). Not reentrant."""
        if self._sink is None or self._batch is not None:
            yield
            return
        self._batch = batch = NetBlockEvents()
        try:
            yield
        finally:
            self._batch = None
            for ev in batch.events(self.block_shape[2], MEDIUM_L2):
                self._emit(ev)

    def put(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
            block: Any) -> bool:
        """Store a copy of ``block`` (contract layout, any device) under ``block_hash``.

        Already present → only refreshed to most-recently-used. Evicts the LRU entry
        when full (emitting ``BlockRemoved``). Returns True if the block is held afterwards.
        A ``list`` of ``token_ids`` goes into the event as given (ints, not mutated later by
        the caller); any other sequence is converted to a list of ints.
        """
        if not self.enabled:
            return False
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        if not self._free:
            old_hash, slot = self._lru.popitem(last=False)
            self._free.append(slot)
            self.num_evictions += 1
            if self._batch is not None:
                self._batch.remove(old_hash)
            else:
                self._emit(BlockRemoved(block_hashes=[old_hash], medium=MEDIUM_L2))
        slot = self._free.pop()
        self.arrays.copy_into(self.data[slot], block)
        self._lru[block_hash] = slot
        self.num_stores += 1
        if self._sink is None:
            return True
        toks = token_ids if type(token_ids) is list else [int(t) for t in token_ids]
        if self._batch is not None:
            self._batch.store(block_hash, parent_hash, toks)
        else:
            self._emit(BlockStored(block_hashes=[block_hash], parent_block_hash=parent_hash, token_ids=toks,
                                   block_size=self.block_shape[2], medium=MEDIUM_L2))
        return True

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading ``block_hashes`` present (no LRU update)."""
        n = 0
        for h in block_hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def touch(self, block_hash: int) -> None:
        """Mark an entry most-recently-used (no-op on a miss)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def get(self, block_hash: int) -> Any:
        """View of the stored block (valid until the next :meth:`put`); marks it MRU.
        Raises ``KeyError`` on a miss."""
        slot = self._lru[block_hash]
        self._lru.move_to_end(block_hash)
        self.num_hits += 1
        return self.data[slot]

    def hashes(self) -> list[int]:
        """Block hashes held, least recently used first."""
        return list(self._lru)

    def clear(self) -> None:
        """Drop everything (no per-block events; the caller emits ``AllBlocksCleared``)."""
        self._free.extend(self._lru.values())
        self._lru.clear()

    def stats(self) -> dict[str, int]:
        """``num_slots``, ``num_used``, ``block_bytes``, counters."""
        return {"num_slots": self.num_slots, "num_used": len(self._lru), "block_bytes": self.block_bytes,
                "num_stores": self.num_stores, "num_evictions": self.num_evictions, "num_hits": self.num_hits}

    def check_invariants(self) -> None:
        """Raises ``AssertionError`` if slots are lost or double-used."""
        used = list(self._lru.values())
        assert len(set(used)) == len(used), "slot used twice"
        assert not (set(used) & set(self._free)), "slot both used and free"
        assert len(used) + len(self._free) == self.num_slots, "slot leaked"
