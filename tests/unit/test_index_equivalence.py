"""The router's prefix index (vectorised mask tables, ``cpd.router.mask_table``) answers exactly
what a plain per-block, per-tier, per-worker reference answers, over random event sequences:
stores and removals anywhere in chains, L1 → L2 moves, whole-worker clears, drops and
replacements (snapshots), stale and gapped batches, L3 chunks stored / removed / observed,
pending write-throughs, more than 63 workers (two planes), hashes outside ``[0, 2**64)``,
numpy queries. Small tables and small vectorisation thresholds force probing collisions,
deletions, rebuilds and both update paths."""
from __future__ import annotations

import random
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, Sequence, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.kv.events import MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from cpd.policy.routing import PrefixMatch
from cpd.router import index, mask_table
from cpd.router.index import PENDING_GRACE_S, PrefixIndex
from cpd.router.mask_table import MaskTable

M64 = (1 << 64) - 1
EDGE_KEYS = [0, 1, M64, 1 << 63, (1 << 63) - 1, -1, 1 << 64, -(1 << 70)]  # the last three: outside u64
CONFIGS = [  # (MIN_SLOTS, SCALAR_MAX, STRAGGLERS, walk rounds: first (one by one), second, growth)
    (8, 0, 0, 0, 1, 2),  # everything vectorised, tiny tables, many walk rounds
    (8, 3, 2, 4, 8, 3),  # both update paths
    (16, 1_000_000, 1_000_000, 2, 3, 8),  # everything one by one
    (1024, 32, mask_table.STRAGGLERS, index._FIRST_CHUNK, index._SECOND_CHUNK, index._CHUNK_GROWTH),  # defaults
]


@contextmanager
def _config(min_slots: int, scalar_max: int, stragglers: int, first_chunk: int, second_chunk: int,
            growth: int) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mask_table, "MIN_SLOTS", min_slots)
        mp.setattr(mask_table, "SCALAR_MAX", scalar_max)
        mp.setattr(mask_table, "STRAGGLERS", stragglers)
        mp.setattr(index, "_FIRST_CHUNK", first_chunk)
        mp.setattr(index, "_SECOND_CHUNK", second_chunk)
        mp.setattr(index, "_CHUNK_GROWTH", growth)
        yield


# --- MaskTable against a dict ---------------------------------------------------------------
def _check_table(t: MaskTable, ref: list[dict[int, int]]) -> None:
    for tier, r in enumerate(ref):
        assert sorted(t.items(tier)) == sorted(r.items())
        assert t.num_pairs[tier] == sum(bin(m).count("1") for m in r.values())
    keys = set(ref[0]) | set(ref[1])
    assert len(t) == len(keys)
    probe = list(keys) + EDGE_KEYS + [12345]
    assert [t.get(k) for k in probe] == [(ref[0].get(k, 0), ref[1].get(k, 0)) for k in probe]
    u64 = [k for k in probe if 0 <= k <= M64]
    assert t.lookup(np.array(u64, dtype=np.uint64)).tolist() == [[ref[0].get(k, 0), ref[1].get(k, 0)] for k in u64]
    # bounded: load <= MAX_LOAD, and shrunk when live keys fall below 1/16
    assert t._used <= mask_table.MAX_LOAD * t.num_slots()
    assert t.num_slots() <= max(mask_table.MIN_SLOTS, 16 * t._live)


@pytest.mark.parametrize("config", CONFIGS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mask_table_is_a_dict_of_masks_per_tier(config, data):
    with _config(*config):
        pool = data.draw(st.lists(st.integers(0, M64), min_size=1, max_size=60, unique=True)) + EDGE_KEYS
        t, ref = MaskTable(), [{}, {}]
        for _ in range(data.draw(st.integers(1, 40))):
            op = data.draw(st.sampled_from(["add", "add", "remove", "clear"]))
            tier = data.draw(st.integers(0, 1))
            bit = 1 << data.draw(st.integers(0, 62))
            keys = data.draw(st.lists(st.sampled_from(pool), max_size=80))
            if op == "add":
                t.add(tier, bit, keys)
                for k in keys:
                    ref[tier][k] = ref[tier].get(k, 0) | bit
            elif op == "remove":
                t.remove(tier, bit, keys)
                for k in keys:
                    if ref[tier].get(k, 0) & bit:
                        ref[tier][k] ^= bit
                        if not ref[tier][k]:
                            del ref[tier][k]
            else:
                t.clear_bit(bit)
                for r in ref:
                    for k in [k for k, m in r.items() if m & bit]:
                        r[k] ^= bit
                        if not r[k]:
                            del r[k]
            _check_table(t, ref)


# --- PrefixIndex against a reference ----------------------------------------------------------
class RefIndex:
    """The index's rules written out block by block, tier by tier, worker by worker."""

    def __init__(self) -> None:
        self.l1: dict[str, set[int]] = {}
        self.l2: dict[str, set[int]] = {}
        self.last_seq: dict[str, int] = {}
        self.chunks: dict[int, set[int]] = {}  # last hash -> chunk sizes
        self.pending: OrderedDict[int, float] = OrderedDict()

    def apply_batch(self, w: str, seq: int, events: list) -> None:
        stale = w in self.last_seq and seq <= self.last_seq[w]  # older than an L1/L2 snapshot: L3 only
        if not stale:
            self.last_seq[w] = seq
        for ev in events:
            if stale and getattr(ev, "medium", None) != MEDIUM_L3:
                continue
            if isinstance(ev, AllBlocksCleared):
                self.l1.setdefault(w, set()).clear()
                self.l2.setdefault(w, set()).clear()
            elif ev.medium == MEDIUM_L3:
                if not ev.block_hashes:
                    continue
                last, n = ev.block_hashes[-1], len(ev.block_hashes)
                if isinstance(ev, BlockStored):
                    self.chunks.setdefault(last, set()).add(n)
                    for h in ev.block_hashes:
                        self.pending.pop(h, None)
                elif n in self.chunks.get(last, ()):
                    self.chunks[last].discard(n)
                else:
                    self.chunks.pop(last, None)
            else:
                tier = (self.l2 if ev.medium == MEDIUM_L2 else self.l1).setdefault(w, set())
                if isinstance(ev, BlockStored):
                    tier.update(ev.block_hashes)
                else:
                    tier.difference_update(ev.block_hashes)

    def replace_worker(self, w: str, l1: list[int], l2: list[int], seq: int | None) -> None:
        self.l1[w], self.l2[w] = set(l1), set(l2)
        if seq is not None:
            self.last_seq[w] = seq

    def drop_worker(self, w: str) -> None:
        self.l1.pop(w, None)
        self.l2.pop(w, None)
        self.last_seq.pop(w, None)

    def observe_l3(self, hashes: list[int], present: list[tuple[int, int]], gone: list[tuple[int, int]]) -> None:
        for h in hashes:
            for n in list(self.chunks.get(h, ())):
                if (h, n) not in present:
                    self.chunks[h].discard(n)
        for h, n in present:
            self.chunks.setdefault(h, set()).add(n)
        for h, n in gone:
            self.chunks.get(h, set()).discard(n)

    def add_pending(self, hashes: list[int], ready: float) -> None:
        for h in hashes:
            self.pending[h] = ready
            self.pending.move_to_end(h)

    def _l3_leading(self, hs: list[int], cap: int | None, start: int) -> int:
        hs = hs if cap is None else hs[:max(0, cap)]
        covered = min(max(0, start), len(hs))
        for j in range(covered, len(hs)):
            if any(j - n + 1 <= covered for n in self.chunks.get(hs[j], ())):
                covered = j + 1
        return covered

    def match(self, hs: list[int], cap: int | None, now: float) -> PrefixMatch:
        l1, l2, l3_after = {}, {}, {}
        l3 = self._l3_leading(hs, cap, 0)
        for w in set(self.l1) | set(self.l2):
            a = 0
            while a < len(hs) and hs[a] in self.l1.get(w, ()):
                a += 1
            b = a
            while b < len(hs) and hs[b] in self.l2.get(w, ()):
                b += 1
            if a:
                l1[w] = a
            if b > a:
                l2[w] = b
            if b:
                start = b if cap is None else min(b, max(0, cap))
                after = self._l3_leading(hs, cap, start)
                if after > start:
                    l3_after[w] = after
        while self.pending and next(iter(self.pending.values())) + PENDING_GRACE_S < now:
            self.pending.popitem(last=False)
        end = len(hs) if cap is None else min(len(hs), max(0, cap))
        i, ready = l3, now
        while i < end and hs[i] in self.pending:
            ready = max(ready, self.pending[hs[i]])
            i += 1
        pending, ready_s = (i, ready - now) if i > l3 else (0, 0.0)
        return PrefixMatch(l1=l1, l2=l2, l3=l3, l3_after=l3_after, l3_pending=pending, l3_pending_ready_s=ready_s)

    def sizes(self) -> dict[str, int]:
        return {"L1": sum(map(len, self.l1.values())), "L2": sum(map(len, self.l2.values())),
                "L3": sum(sum(ns) for ns in self.chunks.values())}


def _slice(rng: random.Random, chains: list[list[int]], lengths=(1, 2, 5, 40, 150, 400)) -> list[int]:
    """A run of one chain: often its head (runs from block 0 are what matches)."""
    c = rng.choice(chains)
    i = 0 if rng.random() < 0.4 else rng.randrange(len(c))
    return c[i:i + rng.choice(lengths)]


def _random_event(rng: random.Random, chains: list[list[int]]):
    medium = rng.choice([MEDIUM_L1, MEDIUM_L1, MEDIUM_L2, MEDIUM_L2, None, MEDIUM_L3])
    r = rng.random()
    if r < 0.6:
        return BlockStored(block_hashes=_slice(rng, chains), parent_block_hash=None, token_ids=[], block_size=4,
                           medium=medium)
    if r < 0.97:  # mostly holes in the middle of chains
        return BlockRemoved(block_hashes=_slice(rng, chains, (1, 1, 3, 40)), medium=medium)
    return AllBlocksCleared()


def _queries(rng: random.Random, chains: list[list[int]]) -> list[list[int]]:
    c = rng.choice(chains)
    cut = rng.randrange(len(c) + 1)
    tweaked = list(c)
    tweaked[rng.randrange(len(c))] = rng.getrandbits(64)
    return [c, c[:cut], tweaked, c[:cut] + [rng.getrandbits(64)] + c[cut:], []]


def _check_match(idx: PrefixIndex, ref: RefIndex, rng: random.Random, chains: list[list[int]], now: float) -> None:
    for q in _queries(rng, chains):
        cap = rng.choice([None, None, len(q) - 1, len(q) // 2, 0, -3, len(q) + 5])
        want = ref.match(q, cap, now)
        assert idx.match(q, l3_max_blocks=cap, now_s=now) == want, (q, cap)
        if all(0 <= h <= M64 for h in q):
            arr = cast(Sequence[int], np.array(q, dtype=np.uint64))  # a numpy query: the same answer
            assert idx.match(arr, l3_max_blocks=cap, now_s=now) == want
    assert idx.sizes() == ref.sizes()


def _run_sequence(seed: int, num_workers: int, num_ops: int) -> None:
    rng = random.Random(seed)
    chains = [[rng.getrandbits(64) for _ in range(rng.choice([3, 70, 300]))] for _ in range(4)]
    chains.append(list(EDGE_KEYS) + chains[0][:20])  # edge values, some outside u64, inside a chain
    workers = [f"w{i}" for i in range(num_workers)]
    idx, ref = PrefixIndex(), RefIndex()
    seqs: dict[str, int] = {}
    now = 1000.0
    for _ in range(num_ops):
        r = rng.random()
        w = rng.choice(workers)
        if r < 0.6:  # a batch: usually the next seq, sometimes stale or after a gap
            seq = seqs.get(w, 0) + rng.choice([1, 1, 1, 1, 0, -2, 3])
            seqs[w] = max(seqs.get(w, 0), seq)
            evs = [_random_event(rng, chains) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.2:  # an L1 -> L2 move of one slice
                hs = _slice(rng, chains)
                evs += [BlockRemoved(block_hashes=hs, medium=MEDIUM_L1),
                        BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=4,
                                    medium=MEDIUM_L2)]
            idx.apply_batch(w, seq, KVEventBatch(ts=0, events=evs))
            ref.apply_batch(w, seq, evs)
        elif r < 0.67:
            idx.drop_worker(w)
            ref.drop_worker(w)
            seqs.pop(w, None)
        elif r < 0.74:
            l1 = _slice(rng, chains) + _slice(rng, chains)
            l2 = _slice(rng, chains)
            snap_seq: int | None = rng.choice([None, seqs.get(w, 0) + 5])
            if snap_seq is not None:
                seqs[w] = snap_seq
            idx.replace_worker(w, l1, l2, snap_seq)
            ref.replace_worker(w, l1, l2, snap_seq)
        elif r < 0.82:
            hs = _slice(rng, chains)
            present = [(h, rng.choice([1, 2, 4, 16])) for h in rng.sample(hs, min(len(hs), 2))]
            gone = [(h, rng.choice([1, 2])) for h in rng.sample(hs, min(len(hs), 1))]
            idx.observe_l3(hs, present, gone)
            ref.observe_l3(hs, present, gone)
        elif r < 0.9:
            hs, ready = _slice(rng, chains), now + rng.uniform(-8.0, 3.0)
            idx.add_pending_writes(hs, ready)
            ref.add_pending(hs, ready)
        elif r < 0.93:
            hs = _slice(rng, chains)
            idx.drop_pending_writes(hs)
            for h in hs:
                ref.pending.pop(h, None)
        else:
            now += rng.uniform(0.0, 3.0)
        _check_match(idx, ref, rng, chains, now)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("num_workers", [3, 70])  # 70: two planes of workers
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_index_matches_reference_over_random_events(config, num_workers, seed):
    with _config(*config):
        _run_sequence(seed, num_workers, num_ops=60)


def test_worker_bits_beyond_one_plane_are_independent():
    """Workers 0 and 63 share a local bit in two planes: each sees only its own blocks."""
    idx = PrefixIndex()
    for i in range(64):
        idx.apply_batch(f"w{i}", 0, KVEventBatch(ts=0, events=[]))
        idx.replace_worker(f"w{i}", [], [])
    idx.replace_worker("w0", [1, 2, 3], [])
    idx.replace_worker("w63", [1], [2, 3, 4])
    m = idx.match([1, 2, 3, 4, 5])
    assert m.l1 == {"w0": 3, "w63": 1} and m.l2 == {"w63": 4}
    idx.drop_worker("w0")
    assert idx.match([1, 2, 3, 4, 5]).l1 == {"w63": 1}
