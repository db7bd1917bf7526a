"""The simulated router learns its cost model as the live router does (EngineClusterSpec.learn_like_live):
it starts from the instances' advertised CostPrior (cpd.costmodel.prior, as cpd.worker.server does),
and it observes each answer's L2/L3 loads, not only the prefill times."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from cpd.costmodel.prior import cost_prior
from cpd.engine.scheduler import SchedulerConfig
from cpd.policy.cost_model import RooflineCostModel
from cpd.policy.routing import LinearCostModel, RoutingConfig
from cpd.router.estimates import CostEstimates
from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator, instance_cost_prior
from cpd.sim.workload import SimRequest
from cpd.types import WriteThrough

BS = 512
COST = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=1)
SCHED = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=32, max_prefill_chunk_tokens=4096, block_size=BS)
BASE = LinearCostModel(kv_bytes_per_token=COST.kv_bytes_per_token)  # the live router's (cpd.router.app)


def _cluster(l3_bytes: int, l1_blocks: int = 60) -> EngineClusterSpec:
    # two prefill workers with a small L1 and no L2: a session's next turn on the other worker (or
    # after eviction) loads its prefix from L3
    insts = (EngineInstanceSpec("prefill", COST, SCHED, l1_blocks, 0), EngineInstanceSpec("prefill", COST, SCHED,
                                                                                          l1_blocks, 0),
             EngineInstanceSpec("decode", COST, SCHED, 400, 0))
    routing = RoutingConfig(topology="pd", block_size=BS, write_through=WriteThrough.ALL if l3_bytes else
                            WriteThrough.NONE)
    return EngineClusterSpec(insts, routing, BASE, BS, l3_bytes=l3_bytes, kv_event_delay_s=0.01,
                             learn_router_cost=True, learn_like_live=True)


def _requests(n: int = 80, seed: int = 3) -> list[SimRequest]:
    rng = random.Random(seed)
    sessions = [tuple(range(s * 1000, s * 1000 + 30)) for s in range(12)]
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(4.0)
        k = rng.randrange(6, 30)
        out.append(SimRequest(t, k * BS - rng.randrange(1, 300), 4, sessions[rng.randrange(12)][:k]))
    return out


def test_the_router_starts_from_the_advertised_cost_prior():
    """Before any answer the estimates are the mean of what the instances advertise (every instance:
    the full-step rate and the L2 link; L3 only the ones with a store), the base model elsewhere."""
    prior = cost_prior(COST, max_num_batched_tokens=4096, max_prefill_chunk_tokens=4096)
    with_l3 = EngineSimulator(_cluster(1 << 40), []).router_cost_model()
    assert with_l3.prefill_tokens_per_s == pytest.approx(prior.prefill_tokens_per_s)
    assert with_l3.l2_bytes_per_s == pytest.approx(COST.link_bytes_per_s("L2"))
    assert with_l3.l3_bytes_per_s == pytest.approx(COST.link_bytes_per_s("L3"))
    no_l3 = EngineSimulator(_cluster(0), []).router_cost_model()
    assert no_l3.l3_bytes_per_s == BASE.l3_bytes_per_s  # nobody advertises L3: the live default
    assert no_l3.prefill_tokens_per_s == pytest.approx(prior.prefill_tokens_per_s)
    assert instance_cost_prior(_cluster(0).instances[0], has_l3=False) == {
        "prefill_tokens_per_s": prior.prefill_tokens_per_s, "attn_coeff": prior.attn_coeff,
        "l2_bytes_per_s": prior.l2_bytes_per_s}
    assert COST.prefill_attn_coeff > 0 and with_l3.attn_coeff == pytest.approx(COST.prefill_attn_coeff)  # its shape
    # the live CostEstimates fed the same advertisements gives the same model
    est = CostEstimates(BASE)
    for i, spec in enumerate(_cluster(1 << 40).instances):
        est.advertise(f"w{i}", instance_cost_prior(spec, has_l3=spec.role != "decode"))
    assert est.model() == with_l3


def test_the_router_measures_l3_loads_as_the_live_router_does():
    """With L3 loads in the run, the L3 bandwidth is measured (EWMA of bytes / modeled load
    seconds): below the link's (each load pays the link latency too), never above; the prefill rate
    moved from the prior. Without learn_like_live the L3 figure stays the start's."""
    sim = EngineSimulator(_cluster(1 << 40), _requests()).run()
    assert sum(r["l3"] for r in sim.rec) > 0, "the workload must load from L3"
    est = sim.estimates
    assert est is not None and {"l3_bytes_per_s", "prefill_tokens_per_s"} <= est.measured
    link = COST.link_bytes_per_s("L3")
    m = sim.router_cost_model()
    assert 0 < m.l3_bytes_per_s < link
    blocks_s = BS * COST.kv_bytes_per_token / COST.transfer_time_s("L3", BS * COST.kv_bytes_per_token)
    assert m.l3_bytes_per_s >= blocks_s * 0.999  # no load is smaller than one block
    prefill_only = EngineSimulator(replace(_cluster(1 << 40), learn_like_live=False), _requests()).run()
    assert prefill_only.router_cost_model().l3_bytes_per_s == BASE.l3_bytes_per_s


def test_a_learning_run_is_byte_identical():
    def run() -> str:
        sim = EngineSimulator(_cluster(1 << 40), _requests()).run()
        m = sim.router_cost_model()
        return json.dumps({"rec": sim.rec, "busy": sim.busy_s(), "cost": [m.prefill_tokens_per_s, m.l3_bytes_per_s]},
                          sort_keys=True)
    assert run() == run()


@pytest.mark.parametrize("next_flush", [False, True])
def test_write_through_events_go_out_with_the_next_flush_as_live(next_flush):
    """Live, a step's write-through reaches the store's writer thread at the step's end, after the
    worker has flushed that step's events: its BlockStored(L3) goes out with the next flush (after
    the next step, or the idle loop's flush). Two 4-block prompts, one per step: A's L3 events
    arrive with B's step, B's idle_flush_s after it; without the option, each with its own step."""
    from cpd.kv.events import MEDIUM_L1, MEDIUM_L3, BlockStored

    sched = SchedulerConfig(max_num_batched_tokens=4 * BS, max_num_seqs=8, max_prefill_chunk_tokens=4 * BS,
                            block_size=BS)
    insts = (EngineInstanceSpec("prefill", COST, sched, 200, 0), EngineInstanceSpec("decode", COST, sched, 200, 0))
    cl = EngineClusterSpec(insts, RoutingConfig(topology="pd", block_size=BS, write_through=WriteThrough.ALL), BASE,
                           BS, l3_bytes=1 << 40, kv_event_delay_s=0.01, l3_events_next_flush=next_flush,
                           idle_flush_s=0.02)
    reqs = [SimRequest(0.0, 4 * BS, 2, (1, 2, 3, 4)), SimRequest(0.0, 4 * BS, 2, (11, 12, 13, 14))]
    sim = EngineSimulator(cl, reqs)
    seen: dict[tuple[str, int], float] = {}
    apply = sim._apply_events

    def spy(now, wid, seq, batch):
        for ev in batch.events:
            if isinstance(ev, BlockStored) and wid.startswith("prefill"):
                for h in ev.block_hashes:
                    seen.setdefault((ev.medium, h), now)
        apply(now, wid, seq, batch)
    sim._apply_events = spy
    hashes = [sim._prompt(r)[1] for r in reqs]
    sim.run()
    (a, b) = [[(seen[(MEDIUM_L1, h)], seen[(MEDIUM_L3, h)]) for h in hs] for hs in hashes]
    a_l1, a_l3 = a[0]
    b_l1, b_l3 = b[0]
    assert a_l1 < b_l1, "one prompt per step"
    if next_flush:
        assert a_l3 == pytest.approx(b_l1)  # with the next step's events
        assert b_l3 == pytest.approx(b_l1 + 0.02)  # idle: the loop's flush
    else:
        assert (a_l3, b_l3) == (pytest.approx(a_l1), pytest.approx(b_l1))
