"""L1 paged KV pool with a prefix cache (after vLLM's block pool / prefix caching).

One preallocated tensor ``kv`` of shape
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` holds all KV.
Every block is in exactly one state:

* **free** — no owner, no hash: allocated first.
* **in use** — ``ref_count > 0``: owned by one or more sequences. Never evicted or overwritten.
* **cached, evictable** — ``ref_count == 0`` but registered in the prefix cache under
  its chained block hash; kept in LRU order and reclaimed (evicted) only when a
  free block is needed. Before reuse its KV is spilled to the L2 :class:`HostPool`
  (if one is attached).

Full blocks are registered under ``cpd.kv.block_hash`` hashes by the engine once
their KV is computed. Events (``medium=MEDIUM_L1`` = "GPU") go to the ``event_sink``:
``BlockStored`` on registration, ``BlockRemoved`` on eviction, ``AllBlocksCleared``
on :meth:`KVPool.reset_prefix_cache`.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Sequence

from cpd.engine.connector import EventSink
from cpd.engine.host_pool import HostPool
from cpd.kv.events import MEDIUM_L1, AllBlocksCleared, BlockRemoved, BlockStored
from cpd.engine.kv_arrays import KVArrays, TorchKVArrays

if TYPE_CHECKING:
    import torch


class NoFreeBlocks(RuntimeError):
    """Raised by :meth:`KVPool.allocate` when fewer blocks are free + evictable than asked."""


class KVPool:
    """Paged device KV pool with ref counts, prefix cache and LRU eviction.

    Args:
        num_layers, num_kv_heads, head_dim: model shapes.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype, device: of the KV tensor (torch arrays, when ``arrays`` is None).
        arrays: the kind of KV array (:mod:`cpd.engine.kv_arrays`; numpy for a modeled engine).
        event_sink: receives L1 events (optional).
        host_pool: L2 pool that receives evicted cached blocks (optional).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 event_sink: EventSink | None = None, host_pool: HostPool | None = None,
                 arrays: KVArrays | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.arrays = arrays or TorchKVArrays(dtype, device)
        self.kv = self.arrays.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim))
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # block -> (parent hash, token list, start): the block's tokens are list[start:start + block_size]
        # (a run registered at once shares one list, sliced per block only when spilled to L2)
        self._meta: dict[int, tuple[int | None, list[int], int]] = {}
        self.cached: dict[int, int] = {}  # hash -> block
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._sink = event_sink
        self.host_pool = host_pool
        self.num_evictions = 0

    # ------------------------------------------------------------------ helpers
    def _emit(self, ev) -> None:
        if self._sink is not None:
            self._sink(ev)

    def block_view(self, block: int) -> Any:
        """``[num_layers, 2, block_size, num_kv_heads, head_dim]`` view of one block (not contiguous)."""
        return self.kv[:, :, block]

    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free + cached-evictable)."""
        return len(self._free) + len(self._evictable)

    def num_exclusive_blocks(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` their holder alone references (what releasing them frees)."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 1)

    # ------------------------------------------------------------------ prefix cache
    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of leading ``block_hashes`` (refs untouched)."""
        out = []
        for h in block_hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Add one reference to each block (a cached-evictable block becomes in use)."""
        for b in blocks:
            if self.ref[b] == 0:
                self._evictable.pop(b, None)
            self.ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block. Blocks reaching 0 become free, or, if cached,
        evictable (most recent last). Pass a sequence's blocks in order: they are
        released tail first so the tail is evicted before the shared head.
        Raises ``AssertionError`` on a block that has no reference."""
        for b in reversed(blocks):
            assert self.ref[b] > 0, f"block {b} released twice"
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> bool:
        """Publish a full, computed, in-use block under ``block_hash``.

        Returns False (and changes nothing) if the block already has a hash or another
        block already caches this hash (duplicate computation). A ``list`` of ``token_ids``
        is kept as given (no per-token copy); any other sequence is converted to a list of
        ints. One block's :meth:`register_run`."""
        toks = token_ids if type(token_ids) is list else [int(t) for t in token_ids]
        return self.register_run((block,), (block_hash,), parent_hash, toks) == 1

    def register_run(self, blocks: Sequence[int], block_hashes: Sequence[int], parent_hash: int | None,
                     token_ids: list[int]) -> int:
        """:meth:`register` a chain of blocks at once: ``blocks[i]`` under ``block_hashes[i]``, whose
        parent is ``block_hashes[i - 1]`` (``parent_hash`` for the first), with tokens
        ``token_ids[i * block_size:(i + 1) * block_size]`` (a list of ints, kept as given). The
        same blocks are registered and skipped as by one :meth:`register` per block, in order, but
        each run of consecutive registered blocks is announced by one ``BlockStored`` (its hashes,
        the parent of its first, its tokens: vLLM's event for a request's newly full blocks).
        Returns how many were registered."""
        bs = self.block_size
        n = 0
        start = -1  # first block of the pending run of registered blocks
        for i, (b, h) in enumerate(zip(blocks, block_hashes)):
            if self.block_hash[b] is not None or h in self.cached:  # as register(): skipped
                self._emit_run(block_hashes, parent_hash, token_ids, start, i)
                start = -1
                continue
            self.block_hash[b] = h
            self._meta[b] = (block_hashes[i - 1] if i else parent_hash, token_ids, i * bs)
            self.cached[h] = b
            n += 1
            if start < 0:
                start = i
        self._emit_run(block_hashes, parent_hash, token_ids, start, len(blocks))
        return n

    def _emit_run(self, hashes: Sequence[int], parent_hash: int | None, token_ids: list[int], s: int, e: int) -> None:
        """``BlockStored`` of blocks ``s .. e-1`` of a run (nothing if ``s < 0``)."""
        if s < 0 or self._sink is None:
            return
        bs = self.block_size
        whole = s == 0 and e * bs == len(token_ids)
        self._emit(BlockStored(block_hashes=list(hashes[s:e]), parent_block_hash=hashes[s - 1] if s else parent_hash,
                               token_ids=token_ids if whole else token_ids[s * bs:e * bs],
                               block_size=bs, medium=MEDIUM_L1))

    def _evict_one(self, removed: list[int]) -> int:
        """Reclaim the LRU cached block (spilled to L2 first); its hash goes to ``removed`` (the
        caller announces them in one ``BlockRemoved``)."""
        b, _ = self._evictable.popitem(last=False)
        h = self.block_hash[b]
        if h is None:
            raise RuntimeError(f"evictable block {b} has no block hash")
        parent, toks, start = self._meta.pop(b)
        if self.host_pool is not None and self.host_pool.enabled:
            # spill before reuse
            self.host_pool.put(h, parent, toks[start:start + self.block_size], self.block_view(b))
        del self.cached[h]
        self.block_hash[b] = None
        self.num_evictions += 1
        removed.append(h)
        return b

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with one reference each: free ones first, then LRU evictions (their L2
        spills announced together, as runs: :meth:`HostPool.batched_events`; then their L1 removal
        in one ``BlockRemoved``).

        Raises:
            NoFreeBlocks: fewer than ``n`` blocks are free + evictable (nothing changes).
        """
        if n > self.num_free_blocks():
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free_blocks()} free")
        out = []
        removed: list[int] = []
        with self.host_pool.batched_events() if self.host_pool is not None else nullcontext():
            for _ in range(n):
                b = self._free.popleft() if self._free else self._evict_one(removed)
                self.ref[b] = 1
                out.append(b)
        if removed:
            self._emit(BlockRemoved(block_hashes=removed, medium=MEDIUM_L1))
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash in L1 and L2 (in-use blocks stay allocated, unhashed);
        emits ``AllBlocksCleared``."""
        for b in list(self._evictable):
            self._free.append(b)
        self._evictable.clear()
        for h, b in self.cached.items():
            self.block_hash[b] = None
        self.cached.clear()
        self._meta.clear()
        if self.host_pool is not None:
            self.host_pool.clear()
        self._emit(AllBlocksCleared())

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, int]:
        """``num_total``, ``num_free`` (no hash), ``num_cached_evictable``, ``num_in_use``,
        ``num_cached`` (hashed blocks, in use or not), ``num_evictions``."""
        return {"num_total": self.num_blocks, "num_free": len(self._free),
                "num_cached_evictable": len(self._evictable),
                "num_in_use": self.num_blocks - len(self._free) - len(self._evictable),
                "num_cached": len(self.cached), "num_evictions": self.num_evictions}

    def check_invariants(self) -> None:
        """Raises ``AssertionError`` if any bookkeeping is inconsistent: each block in exactly
        one state, ref counts non-negative, cache map and block hashes agree."""
        free, ev = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "block twice in free list"
        assert not (free & ev), "block both free and evictable"
        for b in range(self.num_blocks):
            r, h = self.ref[b], self.block_hash[b]
            assert r >= 0
            if r > 0:
                assert b not in free and b not in ev, f"in-use block {b} listed free/evictable"
            elif h is None:
                assert b in free, f"block {b} lost (ref 0, unhashed, not free)"
            else:
                assert b in ev, f"block {b} lost (ref 0, cached, not evictable)"
            if h is not None:
                assert self.cached.get(h) == b, f"cache map disagrees for block {b}"
                assert b in self._meta
        assert len(self.cached) == sum(1 for h in self.block_hash if h is not None)
        if self.host_pool is not None:
            self.host_pool.check_invariants()
