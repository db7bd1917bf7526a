"""KV events in runs (issue 13, router overhead): the L2 host pool announces one allocation's spills
as their net effect in chains (``HostPool.batched_events``, ``cpd.kv.events.stored_runs``), and the
router's index reads ``BlockStored`` without decoding its tokens (``decode_batch_for_index``).
Both leave every subscriber's view exactly as one event per block, fully decoded, did."""
from __future__ import annotations

import random
from contextlib import nullcontext

import msgspec
import pytest
import torch

from cpd.engine.host_pool import HostPool
from cpd.engine.kv_pool import KVPool
from cpd.kv.events import (MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, BlockRemoved, BlockStored, BlockStoredHashes,
                           decode_batch, decode_batch_for_index, encode_batch, stored_runs)
from cpd.router.index import PrefixIndex

BS = 4
SHAPE = dict(num_layers=1, block_size=BS, num_kv_heads=1, head_dim=2)
BLOCK_SHAPE = (1, 2, BS, 1, 2)
BLOCK_BYTES = 2 * BS * 2 * 4


class _PerBlockHostPool(HostPool):
    """The host pool as it was: one event per block, as it happens."""

    def batched_events(self):  # type: ignore[override]
        return nullcontext()


def _pool(cls, l1_blocks: int, l2_blocks: int, events: list) -> KVPool:
    host = cls(l2_blocks * BLOCK_BYTES, BLOCK_SHAPE, event_sink=events.append)
    return KVPool(num_blocks=l1_blocks, event_sink=events.append, host_pool=host, **SHAPE)


def _blk(h: int, parent: int | None) -> tuple[int, int | None, list[int]]:
    return h, parent, [h] * BS


def test_stored_runs_chains_forwards_and_backwards():
    fwd = [_blk(1, None), _blk(2, 1), _blk(3, 2)]
    back = [_blk(13, 12), _blk(12, 11), _blk(11, 10)]
    evs = stored_runs(fwd + back + [_blk(7, 99), _blk(8, 7), _blk(5, 4)], BS, MEDIUM_L2)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in evs] == [
        ([1, 2, 3], None, [1] * 4 + [2] * 4 + [3] * 4),
        ([11, 12, 13], 10, [11] * 4 + [12] * 4 + [13] * 4),  # chain order: the parent of 11 first
        ([7, 8], 99, [7] * 4 + [8] * 4),
        ([5], 4, [5] * 4)]
    assert all(e.medium == MEDIUM_L2 and e.block_size == BS for e in evs)
    # a chain that turns around is two runs (a BlockStored is one chain)
    assert [e.block_hashes for e in stored_runs([_blk(2, 1), _blk(3, 2), _blk(1, 0)], BS, None)] == [[2, 3], [1]]
    assert stored_runs([], BS, None) == []


def _state(events: list, l1: set[int], l2: set[int]) -> None:
    """Apply events in order to per-tier sets (a subscriber's view of one worker)."""
    for ev in events:
        tier = l2 if ev.medium == MEDIUM_L2 else l1
        if isinstance(ev, BlockStored):
            tier.update(ev.block_hashes)
        else:
            tier.difference_update(ev.block_hashes)


def _check_chains(events: list, parent_of: dict[int, int | None]) -> None:
    """Every BlockStored names a chain with its true parents and its blocks' tokens."""
    for ev in events:
        if isinstance(ev, BlockStored):
            hs = ev.block_hashes
            assert [ev.parent_block_hash] + hs[:-1] == [parent_of[h] for h in hs]
            assert ev.token_ids == [t for h in hs for t in [h % 1000] * BS]


@pytest.mark.parametrize("seed", range(6))
def test_batched_spills_leave_every_view_as_per_block_events(seed):
    """Random sequences of requests through a small L1 and a smaller L2 (an allocation evicts blocks
    it spilled itself): after every step the L1/L2 views built from the batched events equal those
    from one event per block and the pools' own contents; the router's index, fed the batched
    events decoded without tokens, answers every match exactly as one fed the per-block events in
    full; and the batched L2 events are fewer."""
    rng = random.Random(seed)
    l2_blocks = rng.choice([3, 8, 40])
    ev_b: list = []
    ev_1: list = []
    pools = (_pool(HostPool, 24, l2_blocks, ev_b), _pool(_PerBlockHostPool, 24, l2_blocks, ev_1))
    views = [(set(), set()), (set(), set())]
    idx_lean, idx_full = PrefixIndex(), PrefixIndex()
    parent_of: dict[int, int | None] = {}
    chains: list[list[int]] = []
    seq = 0
    num_l2_events = [0, 0]
    for step in range(60):
        n = rng.randint(1, 12)
        if chains and rng.random() < 0.5:  # a follow-up: a prefix of an earlier chain, then new blocks
            base = rng.choice(chains)
            base = base[:rng.randint(0, len(base))]
        else:
            base = []
        hashes = base + [1000 * (step + 1) + 1000 * 100 * seed + i for i in range(n)]
        hashes = hashes[:12]
        for i, h in enumerate(hashes):
            parent_of.setdefault(h, hashes[i - 1] if i else None)
        toks = [t for h in hashes for t in [h % 1000] * BS]
        for p in pools:
            blocks = p.allocate(len(hashes))
            p.register_run(blocks, hashes, None, toks)
            p.release(blocks)
        chains.append(hashes)
        for (l1, l2), ev, p in zip(views, (ev_b, ev_1), pools):
            _state(ev, l1, l2)
            assert l1 == set(p.cached) and l2 == set(p.host_pool.hashes())
        assert views[0] == views[1]
        _check_chains(ev_b, parent_of)
        assert idx_lean.apply_batch("p0", seq, decode_batch_for_index(encode_batch(ev_b, ts=0.0)))
        assert idx_full.apply_batch("p0", seq, decode_batch(encode_batch(ev_1, ts=0.0)))
        seq += 1
        for k, ev in enumerate((ev_b, ev_1)):
            num_l2_events[k] += sum(e.medium == MEDIUM_L2 for e in ev)
        for c in chains[-5:]:
            probe = c + [7]
            assert idx_lean.match(probe) == idx_full.match(probe)
        ev_b.clear()
        ev_1.clear()
    assert idx_lean.sizes() == idx_full.sizes()
    assert num_l2_events[0] < num_l2_events[1] / 2, num_l2_events


def test_one_allocation_spills_in_one_run():
    """A released 8-block sequence evicted by the next allocation: its spill is one BlockStored (in
    chain order), and with L2 full the blocks it pushes out are one BlockRemoved."""
    ev: list = []
    p = _pool(HostPool, 8, 8, ev)
    for first in (100, 200, 300):
        blocks = p.allocate(8)
        hs = [first + i for i in range(8)]
        p.register_run(blocks, hs, None, [t for h in hs for t in [h % 1000] * BS])
        p.release(blocks)
    l2 = [e for e in ev if e.medium == MEDIUM_L2]
    assert [(type(e), e.block_hashes) for e in l2] == [
        (BlockStored, [100 + i for i in range(8)]),  # the first request's spill (L2 was empty)
        (BlockRemoved, [100 + i for i in range(7, -1, -1)]),  # evicted from L2 in its LRU order
        (BlockStored, [200 + i for i in range(8)])]
    assert l2[0].parent_block_hash is None and l2[2].token_ids == [t for i in range(8) for t in [200 + i] * BS]


def test_index_type_skips_tokens_on_the_same_wire():
    """The router's decode gives BlockStoredHashes (tokens left as raw msgpack) for the same payload,
    every other field as the full decode gives it; a vLLM-shaped payload decodes too."""
    evs = [BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(2 * BS)), block_size=BS,
                       medium=MEDIUM_L1),
           BlockRemoved(block_hashes=[1], medium=MEDIUM_L1),
           BlockStored(block_hashes=[5], parent_block_hash=4, token_ids=[9] * BS, block_size=BS, lora_id=3,
                       medium=MEDIUM_L3)]
    payload = encode_batch(evs, ts=2.5)
    lean = decode_batch_for_index(payload)
    assert lean.ts == 2.5 and [type(e) for e in lean.events] == [BlockStoredHashes, BlockRemoved, BlockStoredHashes]
    for full, ev in zip(evs, lean.events):
        if isinstance(full, BlockStored):
            assert isinstance(ev.token_ids, msgspec.Raw)
            assert msgspec.msgpack.decode(ev.token_ids) == full.token_ids
            assert (ev.block_hashes, ev.parent_block_hash, ev.block_size, ev.lora_id, ev.medium) == \
                (full.block_hashes, full.parent_block_hash, full.block_size, full.lora_id, full.medium)
        else:
            assert ev == full
    vllm = msgspec.msgpack.encode([2.0, [["BlockStored", [9], None, [1] * 16, 16, None], ["BlockRemoved", [9]]], 0])
    b = decode_batch_for_index(vllm)
    assert b.events[0].block_hashes == [9] and b.events[0].medium is None and b.events[1] == BlockRemoved([9])
    idx = PrefixIndex()
    idx.apply_batch("p0", 0, lean)
    ref = PrefixIndex()
    ref.apply_batch("p0", 0, decode_batch(payload))
    assert idx.match([1, 2, 5]) == ref.match([1, 2, 5]) and idx.sizes() == ref.sizes()
