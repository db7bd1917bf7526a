"""L1 KVPool and L2 HostPool bookkeeping (no model)."""
from __future__ import annotations

import pytest
import torch

from cpd.engine.host_pool import HostPool
from cpd.engine.kv_pool import KVPool, NoFreeBlocks
from cpd.kv.events import MEDIUM_L1, MEDIUM_L2, AllBlocksCleared, BlockRemoved, BlockStored

SHAPE = dict(num_layers=2, block_size=4, num_kv_heads=2, head_dim=3)


def _pool(num_blocks=4, host_blocks=0, events=None):
    sink = events.append if events is not None else None
    bshape = (SHAPE["num_layers"], 2, SHAPE["block_size"], SHAPE["num_kv_heads"], SHAPE["head_dim"])
    host = HostPool(host_blocks * 2 * 2 * 4 * 2 * 3 * 4, bshape, event_sink=sink)
    return KVPool(num_blocks=num_blocks, event_sink=sink, host_pool=host, **SHAPE)


def test_allocate_release_and_stats():
    p = _pool(4)
    a = p.allocate(3)
    assert p.stats() == {"num_total": 4, "num_free": 1, "num_cached_evictable": 0, "num_in_use": 3,
                         "num_cached": 0, "num_evictions": 0}
    with pytest.raises(NoFreeBlocks):
        p.allocate(2)
    assert p.stats()["num_in_use"] == 3  # failed allocation changed nothing
    p.release(a)
    assert p.stats()["num_in_use"] == 0 and p.stats()["num_free"] == 4
    p.check_invariants()
    with pytest.raises(AssertionError):
        p.release([a[0]])


def test_prefix_cache_lru_eviction_and_events():
    ev = []
    p = _pool(3, events=ev)
    a = p.allocate(2)
    p.kv[:, :, a[0]] = 1.0
    assert p.register(a[0], 11, None, [1, 2, 3, 4])
    assert p.register(a[1], 12, 11, [5, 6, 7, 8])
    assert not p.register(a[1], 13, 11, [0] * 4)  # already hashed
    assert [type(e) for e in ev] == [BlockStored, BlockStored] and ev[0].medium == MEDIUM_L1
    assert ev[1].parent_block_hash == 11 and ev[1].token_ids == [5, 6, 7, 8]
    p.release(a)  # tail released first -> tail is LRU
    assert p.stats()["num_cached_evictable"] == 2 and p.num_free_blocks() == 3
    assert p.match([11, 12, 99]) == a
    # one free block is used before any eviction
    b = p.allocate(1)
    assert not [e for e in ev if isinstance(e, BlockRemoved)]
    c = p.allocate(1)  # evicts the LRU cached block: the tail (12)
    assert c == [a[1]] and p.match([11, 12]) == [a[0]]
    assert isinstance(ev[-1], BlockRemoved) and ev[-1].block_hashes == [12] and ev[-1].medium == MEDIUM_L1
    # an in-use cached block is never evicted
    p.acquire([a[0]])
    with pytest.raises(NoFreeBlocks):
        p.allocate(1)
    assert torch.all(p.kv[:, :, a[0]] == 1.0)
    p.release([a[0]] + b + c)
    p.check_invariants()
    # duplicate hash from another block is not registered
    d = p.allocate(1)
    assert not p.register(d[0], 11, None, [1, 2, 3, 4])
    p.release(d)
    p.reset_prefix_cache()
    assert isinstance(ev[-1], AllBlocksCleared)
    assert p.stats()["num_cached"] == 0 and p.stats()["num_free"] == 3
    p.check_invariants()


def test_eviction_spills_to_host_pool():
    ev = []
    p = _pool(2, host_blocks=2, events=ev)
    assert p.host_pool.num_slots == 2
    for i, h in enumerate([21, 22, 23]):
        (b,) = p.allocate(1)
        p.kv[:, :, b] = float(h)
        p.register(b, h, None, [i] * 4)
        p.release([b])
    # 3 cached blocks through a 2-block L1: 21 was evicted and spilled to L2
    assert p.match([21]) == [] and 21 in p.host_pool
    assert torch.all(p.host_pool.get(21) == 21.0)
    l2 = [e for e in ev if getattr(e, "medium", None) == MEDIUM_L2]
    assert isinstance(l2[0], BlockStored) and l2[0].block_hashes == [21] and l2[0].token_ids == [0] * 4
    # more evictions: L2 evicts its own LRU (21) when full
    for h in (24, 25):
        (b,) = p.allocate(1)
        p.register(b, h, None, [h] * 4)
        p.release([b])
    removed = [e.block_hashes[0] for e in ev if isinstance(e, BlockRemoved) and e.medium == MEDIUM_L2]
    assert removed == [21]
    assert p.host_pool.match([22, 23]) == 2 and len(p.host_pool) == 2
    p.check_invariants()


def test_host_pool_disabled_and_lru():
    hp = HostPool(0, (1, 2, 4, 1, 1))
    assert not hp.enabled and not hp.put(1, None, [0] * 4, torch.zeros(1, 2, 4, 1, 1))
    assert hp.match([1]) == 0
    hp = HostPool(2 * 8 * 4, (1, 2, 4, 1, 1))
    assert hp.num_slots == 2
    for h in (1, 2):
        hp.put(h, None, [h] * 4, torch.full((1, 2, 4, 1, 1), float(h)))
    hp.touch(1)
    hp.put(3, None, [3] * 4, torch.zeros(1, 2, 4, 1, 1))  # evicts 2 (LRU), not 1
    assert 1 in hp and 2 not in hp and 3 in hp
    assert hp.match([1, 3, 2]) == 2
    hp.check_invariants()
    with pytest.raises(KeyError):
        hp.get(2)


def test_register_run_is_register_per_block_with_one_event_per_run():
    """register_run registers and skips exactly the blocks one register() per block would; each
    run of registered blocks is one BlockStored (its hashes, its first block's parent, its tokens),
    and so is each run of blocks spilled to L2 together (their tokens, their first block's parent)."""
    ev_run, ev_one = [], []
    runs, ones = _pool(6, host_blocks=6, events=ev_run), _pool(6, host_blocks=6, events=ev_one)
    for p in (runs, ones):
        (d,) = p.allocate(1)
        p.register(d, 13, None, [9] * 4)  # another block already caches hash 13
    hashes, toks = [11, 12, 13, 14, 15], list(range(20))
    a, b = runs.allocate(5), ones.allocate(5)
    assert runs.register_run(a, hashes, 10, toks) == 4
    assert [ones.register(blk, h, hashes[i - 1] if i else 10, toks[4 * i:4 * i + 4])
            for i, (blk, h) in enumerate(zip(b, hashes))] == [True, True, False, True, True]
    assert runs.block_hash == ones.block_hash and runs.cached == ones.cached
    stored = [e for e in ev_run if isinstance(e, BlockStored)][1:]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == \
        [([11, 12], 10, toks[:8]), ([14, 15], 13, toks[12:])]
    assert all(e.medium == MEDIUM_L1 and e.block_size == 4 for e in stored)
    for p, blocks in ((runs, a), (ones, b)):
        p.release(blocks)
        p.allocate(5)  # evicts every cached block of the run, spilling each to L2
    spilled = [[(e.block_hashes, e.parent_block_hash, e.token_ids) for e in ev
                if isinstance(e, BlockStored) and e.medium == MEDIUM_L2] for ev in (ev_run, ev_one)]
    # evicted tail first (15, 14, 12, 11): each chain spilled is one L2 event, in chain order
    assert spilled[0] == spilled[1] == [([14, 15], 13, toks[12:]), ([11, 12], 10, toks[:8])]
    runs.check_invariants()


def test_allocate_announces_its_evictions_in_one_event():
    ev = []
    p = _pool(3, events=ev)
    a = p.allocate(3)
    p.register_run(a, [1, 2, 3], None, list(range(12)))
    p.release(a)  # tail first: 3, 2, 1 is the LRU order
    p.allocate(2)
    removed = [e for e in ev if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and removed[0].block_hashes == [3, 2] and removed[0].medium == MEDIUM_L1
    assert p.match([1, 2]) == [a[0]]
    p.check_invariants()
