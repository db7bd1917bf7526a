"""The router's index matches a worker's blocks across tiers in the engine's load order
(L1 → L2 → L3): head in L1 + tail in L2, L2 + L3, L1 + L3. Unit cases on the index, and a
live check: a real engine (tiny random Llama, real file:// L3 store) builds the tier state,
its KV events feed the index, the policy's plan predicts the tiers, the engine loads exactly
those tiers and produces the oracle's tokens."""
from __future__ import annotations

import pytest
import torch

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.weights import make_tiny_llama_dir
from cpd.kv.block_hash import hash_blocks
from cpd.kv.events import MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, BlockStored, KVEventBatch
from cpd.policy.routing import LinearCostModel, LoadPlan, PrefixMatch, RoutingConfig, plan_loads
from cpd.router.index import PrefixIndex
from cpd.store import open_store
from cpd.store.connector import L3Connector

BS = 4
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
# loading always beats recomputing under this model, so the plan is the whole match
LOAD_ALWAYS = LinearCostModel(kv_bytes_per_token=1, prefill_tokens_per_s=1.0, l2_bytes_per_s=1e12,
                              l3_bytes_per_s=1e12, l2_overhead_s=0.0, l3_overhead_s=0.0)


def _stored(hashes, medium):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BS, medium=medium)


def _index(events_by_worker):
    idx = PrefixIndex()
    for w, evs in events_by_worker.items():
        idx.apply_batch(w, 0, KVEventBatch(ts=0, events=evs))
    return idx


def test_head_l1_tail_l2_is_one_run():
    idx = _index({"p0": [_stored([1, 2, 3], MEDIUM_L1), _stored([4, 5, 6, 7, 8, 9], MEDIUM_L2)],
                  "p1": [_stored([1, 2, 3], MEDIUM_L1)]})
    m = idx.match(list(range(1, 11)))
    assert m.l1 == {"p0": 3, "p1": 3} and m.l2 == {"p0": 9} and m.l3 == 0
    plan, _ = plan_loads("p0", m, 10 * BS + 1, RoutingConfig(block_size=BS), LOAD_ALWAYS)
    assert plan == LoadPlan(3, 6, 0)


def test_l2_after_l1_stops_at_first_l2_gap_and_never_returns_to_l1():
    # L2 holds 4, 6; L1 holds 1..3 and 5: the engine loads L1 [0,3), L2 [3,4), then stops
    idx = _index({"p0": [_stored([1, 2, 3, 5], MEDIUM_L1), _stored([4, 6], MEDIUM_L2)]})
    m = idx.match([1, 2, 3, 4, 5, 6])
    assert m.l1 == {"p0": 3} and m.l2 == {"p0": 4}


def test_l2_then_l3_and_l1_then_l3():
    idx = _index({"p0": [_stored([1, 2], MEDIUM_L2)], "p1": [_stored([1, 2, 3], MEDIUM_L1)],
                  "pp": [_stored([3, 4, 5], MEDIUM_L3), _stored([6], MEDIUM_L3)]})
    m = idx.match([1, 2, 3, 4, 5, 6, 7])
    assert m.l3 == 0  # the store does not hold the head
    assert m.l2 == {"p0": 2} and m.l1 == {"p1": 3}
    # p1's run ends inside the chunk (3,4,5): a chunk may start before the run's end
    assert m.l3_after == {"p0": 6, "p1": 6}
    cfg = RoutingConfig(block_size=BS)
    assert plan_loads("p0", m, 7 * BS + 1, cfg, LOAD_ALWAYS)[0] == LoadPlan(0, 2, 4)
    assert plan_loads("p1", m, 7 * BS + 1, cfg, LOAD_ALWAYS)[0] == LoadPlan(3, 0, 3)
    # the cap (the engine always computes the last token) bounds the L3 continuation
    m = idx.match([1, 2, 3, 4, 5, 6, 7], l3_max_blocks=4)
    assert m.l3_after == {}  # chunk (3,4,5) ends beyond the cap, so it cannot be served


def test_dropped_worker_bit_reused_without_leaking_blocks():
    idx = _index({"p0": [_stored([1, 2], MEDIUM_L1)], "p1": [_stored([1], MEDIUM_L2)]})
    idx.drop_worker("p0")
    idx.apply_batch("p2", 0, KVEventBatch(ts=0, events=[_stored([9], MEDIUM_L1)]))
    m = idx.match([1, 2])
    assert m.l1 == {} and m.l2 == {"p1": 1}
    assert idx.sizes() == {"L1": 1, "L2": 1, "L3": 0}


# --- live: predicted plan == tiers the engine loads ------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


class _Live:
    """One worker engine + a writer engine sharing a real file:// store; all their KV events
    are collected per publisher as the worker would publish them."""

    def __init__(self, model_dir, tmp_path, num_blocks: int, host_kv_bytes: int):
        self.events = {"p0": [], "pp": []}
        self.store = store = open_store(f"file://{tmp_path}/l3")
        self.writer = Engine(model_dir, num_blocks=64, block_size=BS, event_sink=self.events["pp"].append,
                             connector=L3Connector(store, event_sink=self.events["pp"].append, write_async=False))
        self.worker = Engine(model_dir, num_blocks=num_blocks, block_size=BS, host_kv_bytes=host_kv_bytes,
                             event_sink=self.events["p0"].append,
                             connector=L3Connector(open_store(f"file://{tmp_path}/l3"), write_async=False))

    def write_l3(self, p: list[int]) -> None:
        rid = f"w{len(p)}-{p[0]}"
        self.writer.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=1), write_through=True,
                                              mode="prefill"))
        while self.writer.has_unfinished():
            self.writer.step()
        self.writer.release(rid)

    def l3_tail_only(self, p: list[int], head_blocks: int) -> None:
        """Write ``p``'s blocks to L3, then delete the chunks of its first ``head_blocks``."""
        self.write_l3(p[:head_blocks * BS + 1])
        self.write_l3(p)
        self.store.delete(hash_blocks(p, self.writer.namespace)[:head_blocks])

    def predict_and_run(self, p: list[int]) -> tuple[PrefixMatch, LoadPlan, dict[str, int], list[int]]:
        idx = PrefixIndex()
        for w, evs in self.events.items():
            idx.apply_batch(w, 0, KVEventBatch(ts=0, events=[e for e in evs if w == "p0" or e.medium == MEDIUM_L3]))
        hs = hash_blocks(p, self.worker.namespace)
        m = idx.match(hs, l3_max_blocks=(len(p) - 1) // BS)
        plan, _ = plan_loads("p0", m, len(p), RoutingConfig(block_size=BS), LOAD_ALWAYS)
        self.worker.add_request(EngineRequest("x", p, GREEDY))
        toks, tiers = [], None
        while self.worker.has_unfinished():
            for o in self.worker.step():
                toks.extend(o.new_token_ids)
                tiers = tiers or o.num_cached_tokens_by_tier
        return m, plan, tiers, toks


def _oracle(model_dir, p):
    return Engine(model_dir, num_blocks=64, block_size=BS).generate(p, GREEDY)


def _as_tokens(plan: LoadPlan) -> dict[str, int]:
    return {"L1": plan.l1_blocks * BS, "L2": plan.l2_blocks * BS, "L3": plan.l3_blocks * BS}


def test_live_head_l1_tail_l2(model_dir, tmp_path):
    live = _Live(model_dir, tmp_path, num_blocks=10, host_kv_bytes=1 << 20)
    p = _prompt(1, 8 * BS + 1)
    live.worker.generate(p, GREEDY)
    live.worker.generate(_prompt(2, 5 * BS), GREEDY)  # evicts p's tail blocks into L2
    m, plan, tiers, toks = live.predict_and_run(p)
    assert plan.l1_blocks > 0 and plan.l2_blocks > 0, m  # the case under test happened
    assert tiers == _as_tokens(plan)
    assert toks == _oracle(model_dir, p)


def test_live_l1_head_l3_tail(model_dir, tmp_path):
    live = _Live(model_dir, tmp_path, num_blocks=64, host_kv_bytes=0)
    p = _prompt(3, 8 * BS + 1)
    live.l3_tail_only(p, 3)
    live.worker.generate(p[:3 * BS + 1], GREEDY)  # the worker holds the head in L1
    m, plan, tiers, toks = live.predict_and_run(p)
    assert m.l3 == 0 and plan.l1_blocks == 3 and plan.l3_blocks > 0, m
    assert tiers == _as_tokens(plan)
    assert toks == _oracle(model_dir, p)


def test_live_l2_head_l3_tail(model_dir, tmp_path):
    live = _Live(model_dir, tmp_path, num_blocks=12, host_kv_bytes=1 << 20)
    p = _prompt(4, 8 * BS + 1)
    live.l3_tail_only(p, 3)
    live.worker.generate(p[:3 * BS + 1], GREEDY)
    live.worker.generate(_prompt(5, 9 * BS), GREEDY)  # pushes the head out of L1 into L2
    m, plan, tiers, toks = live.predict_and_run(p)
    assert m.l3 == 0 and plan.l2_blocks > 0 and plan.l3_blocks > 0, m
    assert tiers == _as_tokens(plan)
    assert toks == _oracle(model_dir, p)
