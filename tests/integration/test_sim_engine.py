"""The simulator core on the live engine objects (cpd.sim.engine_sim): determinism, M/D/1
waiting time, infinite-cache hit ratio, and the live policy / index / engine objects in use."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

import cpd.policy.routing
import cpd.sim.engine_sim as esim
from cpd.engine.engine import Engine
from cpd.engine.scheduler import SchedulerConfig
from cpd.policy.cost_model import RooflineCostModel
from cpd.policy.routing import RoutingConfig
from cpd.router.index import PrefixIndex
from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator
from cpd.sim.workload import SimRequest

BS = 512
COST = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=1)


def _sched(max_seqs=64, chunk=8192):
    return SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=max_seqs, max_prefill_chunk_tokens=chunk,
                           block_size=BS)


def _cluster(topology="cpd", l1=2000, l3_bytes=100 << 30, delay=0.05, prefill_seqs=64):
    roles = ("pre-prefill", "prefill", "decode") if topology == "cpd" else ("prefill", "decode")
    insts = tuple(EngineInstanceSpec(r, COST, _sched(prefill_seqs if r != "decode" else 64), l1,
                                     8 << 30 if r != "decode" else 0) for r in roles)
    return EngineClusterSpec(insts, RoutingConfig(topology=topology, block_size=BS), COST, BS, l3_bytes=l3_bytes,
                             kv_event_delay_s=delay)


def _agent_requests(n=200, qps=5.0, seed=1):
    rng = random.Random(seed)
    sessions = [tuple(range(s * 1000, s * 1000 + 40)) for s in range(20)]
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(qps)
        k = rng.randrange(4, 40)
        out.append(SimRequest(t, k * BS - rng.randrange(1, 300), rng.randrange(2, 30), sessions[rng.randrange(20)][:k]))
    return out


def test_runs_the_live_engine_index_and_policy():
    sim = EngineSimulator(_cluster(), _agent_requests(5))
    assert esim.route is cpd.policy.routing.route
    assert isinstance(sim.index, PrefixIndex)
    assert all(isinstance(w.engine, Engine) for w in sim.insts)
    sim.run()
    assert all(r["done_t"] is not None for r in sim.rec)


def test_engine_step_times_are_the_modeled_ones_as_live():
    """The router's prefill-rate sample is the engine's step figures (as live): in the simulator
    the engine's clock must move during a step by its modeled waits, so the engine's step seconds
    are positive and within its instance's modeled busy time (the rest: loads before the step)."""
    sim = EngineSimulator(_cluster(), _agent_requests(20)).run()
    stepped = [w for w in sim.insts if w.engine.num_steps]
    assert stepped
    for w in stepped:
        assert 0 < w.engine.step_s_total <= w.busy_s + 1e-9, (w.wid, w.engine.step_s_total, w.busy_s)


def test_two_runs_are_byte_identical():
    def run():
        sim = EngineSimulator(_cluster(), _agent_requests(150)).run()
        return json.dumps({"rec": sim.rec, "busy": sim.busy_s(), "now": sim.now}, sort_keys=True)
    a, b = run(), run()
    assert a == b
    assert '"l3"' in a


def test_md1_waiting_time_matches_closed_form():
    n_tok = 2048
    cl = _cluster("pd", l1=64, l3_bytes=0, delay=0.0, prefill_seqs=1)
    d = COST.step_time_s([(n_tok, 0)])  # deterministic service time: one prefill step
    rho = 0.7
    rng = random.Random(7)
    t, reqs = 0.0, []
    for k in range(8000):
        t += rng.expovariate(rho / d)
        reqs.append(SimRequest(t, n_tok, 1, tuple(range(4 * k, 4 * k + 4))))  # no reuse
    sim = EngineSimulator(cl, reqs).run()
    waits = [r["ttft_t"] - r["arrival"] - d for r in sim.rec[1000:]]
    assert min(waits) > -1e-9
    assert sum(waits) / len(waits) == pytest.approx(rho * d / (2 * (1 - rho)), rel=0.12)


def test_infinite_cache_hit_ratio_is_the_prefix_reuse_of_the_workload():
    reqs = _agent_requests(120, qps=1.0, seed=3)  # spaced: every event is applied before the next arrival
    sim = EngineSimulator(_cluster("pd", l1=100000, l3_bytes=0, delay=0.0), reqs).run()
    seen: set[int] = set()
    want = 0
    for r in sorted(reqs, key=lambda r: r.arrival_s):
        cap = (r.prompt_tokens - 1) // BS
        k = 0
        while k < cap and r.blocks[k] in seen:
            k += 1
        want += k * BS
        seen.update(r.blocks[:r.prompt_tokens // BS])
    assert sum(r["l1"] for r in sim.rec) == want
    assert sum(r["l2"] + r["l3"] for r in sim.rec) == 0


def test_closed_loop_turn_waits_for_the_previous_answer_plus_think_time():
    a = SimRequest(0.0, 3 * BS, 8, (1, 2, 3))
    b = SimRequest(0.0, 5 * BS - 5, 4, (1, 2, 3, 4, 5), after=0, think_s=2.0)
    sim = EngineSimulator(_cluster(), [a, b]).run()
    assert sim.rec[1]["arrival"] == pytest.approx(sim.rec[0]["done_t"] + 2.0)
    assert sim.rec[1]["cls"] == "warm"


def test_prewarmed_sessions_are_hits_in_l3_or_else_in_l2():
    blocks = tuple(range(50, 60))
    req = [SimRequest(1.0, 12 * BS - 5, 2, blocks + (70, 71))]
    with_l3 = EngineSimulator(_cluster(), req, prewarm=[blocks]).run()
    assert with_l3.rec[0]["l3"] == 10 * BS
    without = EngineSimulator(_cluster("pd", l3_bytes=0), req, prewarm=[blocks]).run()
    assert without.rec[0]["l2"] == 10 * BS


def test_elastic_roles_move_a_prefill_worker_to_the_busy_cold_pool():
    """All requests cold (no reuse) at a rate that keeps one pre-prefill worker busy: the live
    planner, called every interval on RoleWindow observations, turns a prefill worker into a
    pre-prefill one, and later cold requests are routed to it."""
    from cpd.policy.roles import PlannerConfig

    roles = ("pre-prefill", "prefill", "prefill", "decode")
    insts = tuple(EngineInstanceSpec(r, COST, _sched(), 2000, 0) for r in roles)
    cl = EngineClusterSpec(insts, RoutingConfig(topology="cpd", block_size=BS), COST, BS, l3_bytes=100 << 30,
                           elastic=PlannerConfig(interval_s=1.0, min_dwell_s=0.0))
    rng = random.Random(5)
    t, reqs = 0.0, []
    for k in range(150):
        t += rng.expovariate(6.0)
        reqs.append(SimRequest(t, 32 * BS - 7, 2, tuple(range(100 * k, 100 * k + 32))))
    sim = EngineSimulator(cl, reqs).run()
    moved = [c for c in sim.role_changes if c["from"] == "prefill" and c["to"] == "pre-prefill"]
    assert moved, sim.role_changes
    first = moved[0]
    later = [r for r in sim.rec if r["arrival"] > first["t"] + 0.5]
    assert any(r["worker"] == first["worker"] and r["pool"] == "pre-prefill" for r in later)
    assert all(r["done_t"] is not None for r in sim.rec)


def test_a_burst_spreads_over_the_decode_workers_and_the_counts_drain():
    """Eight requests arriving together, while no KV has reached a decode worker yet: the simulator
    reports each routed request as a pending handoff of its decode worker (as the live dispatch
    does), so routing rule 6 spreads them two per worker; a one-token request ends on the prefill
    side and leaves the pending count too. At the end every count is back to zero."""
    insts = tuple(EngineInstanceSpec(r, COST, _sched(), 2000, 0) for r in ("prefill",) + ("decode",) * 4)
    cl = EngineClusterSpec(insts, RoutingConfig(topology="pd", block_size=BS), COST, BS, l3_bytes=0)
    reqs = [SimRequest(1e-6 * k, 8 * BS - 3, 1 if k == 0 else 20, tuple(range(10 * k, 10 * k + 8))) for k in range(9)]
    sim = EngineSimulator(cl, reqs).run()
    per_decode = [sum(r["decode"] == w.wid for r in sim.rec[1:]) for w in sim.insts if w.role == "decode"]
    assert per_decode == [2, 2, 2, 2]
    assert all(r["done_t"] is not None for r in sim.rec)
    assert all(w.pending_handoffs == 0 and w.running_requests == 0 for w in sim.insts)


def test_a_learning_router_fits_the_instances_prefill_times_like_the_live_router():
    """With ``learn_router_cost`` (and the fit) the simulated router feeds every prefill (compute time = first
    token - arrival - the engine's queue time on the virtual clock) to the live CostEstimates, so
    a start rate that is 10x off ends close to the instances' roofline on the shapes it saw."""
    from dataclasses import replace

    from cpd.policy.routing import LinearCostModel

    start = LinearCostModel(kv_bytes_per_token=COST.kv_bytes_per_token, prefill_tokens_per_s=1000.0,
                            l2_bytes_per_s=COST.link_bytes_per_s("L2"), l3_bytes_per_s=COST.link_bytes_per_s("L3"))
    cl = replace(_cluster("pd", l3_bytes=0), router_cost=start, learn_router_cost=True, fit_router_cost=True)
    sim = EngineSimulator(cl, _agent_requests(120, qps=2.0)).run()
    assert sim.estimates is not None and sim.estimates.fit_rms_rel_error is not None
    fitted = sim.estimates.model()
    for n, p in ((4 * BS, 0), (2 * BS, 20 * BS), (BS, 35 * BS)):
        assert fitted.prefill_time_s(n, p) == pytest.approx(COST.prefill_time_s(n, p), rel=0.25)
        assert abs(start.prefill_time_s(n, p) / COST.prefill_time_s(n, p) - 1) > 1.0
    fixed = EngineSimulator(_cluster("pd", l3_bytes=0), _agent_requests(5)).run()
    assert fixed.estimates is None


@pytest.mark.parametrize("margin", [2, -1])
def test_the_router_sees_the_decode_workers_blocks_and_a_follow_up_goes_to_their_holder(margin):
    """Prefill nodes TP4, decode ranks TP1 (the reference layout): every engine hashes in the one
    namespace, so the router's index matches the decode worker's L1. A's follow-up B (A's prompt
    plus 4 blocks), routed while A still decodes on its worker and C's worker is idle, goes to
    A's worker (rule 6 prefix affinity: one request above the least-loaded, within the margin);
    with affinity off it goes to the idle worker."""
    cost4 = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=4)
    insts = (EngineInstanceSpec("prefill", cost4, _sched(), 2000, 0),
             *(EngineInstanceSpec("decode", COST, _sched(), 2000, 0) for _ in range(2)))
    cl = EngineClusterSpec(insts, RoutingConfig(topology="pd", block_size=BS, decode_affinity_margin=margin),
                           cost4, BS, l3_bytes=0)
    a_blocks = tuple(range(1, 21))
    reqs = [SimRequest(0.0, 20 * BS, 3000, a_blocks), SimRequest(1e-6, 20 * BS, 2, tuple(range(100, 120))),
            SimRequest(2.0, 24 * BS, 2, a_blocks + (21, 22, 23, 24))]
    seen = []

    def recording_route(n, match, loads, cfg, cost):
        seen.append(dict(match.l1))
        return cpd.policy.routing.route(n, match, loads, cfg, cost)

    esim.route, saved = recording_route, esim.route
    try:
        sim = EngineSimulator(cl, reqs).run()
    finally:
        esim.route = saved
    a, c, b = sim.rec
    assert a["decode"] != c["decode"] and c["done_t"] < 2.0 < a["done_t"]
    assert seen[2][a["decode"]] == 20  # A's whole prompt, in the decode worker's L1
    assert b["decode"] == (a["decode"] if margin >= 0 else c["decode"])


def _ttfts(sim):
    return [round(r["ttft_t"] - r["arrival"], 9) for r in sim.rec]


def test_enough_shared_cores_change_nothing():
    """With as many cores as instances, no step ever waits for a core: the same TTFTs as a
    device per instance."""
    base = EngineSimulator(_cluster(), _agent_requests(60)).run()
    shared = EngineSimulator(dataclasses.replace(_cluster(), cores=3), _agent_requests(60)).run()
    assert _ttfts(shared) == _ttfts(base)
    assert shared.busy_s() == pytest.approx(base.busy_s())


def test_fewer_cores_than_busy_instances_stretch_the_steps():
    """Two prefill instances computing at once on one core take twice as long as on two."""
    insts = tuple(EngineInstanceSpec(r, COST, _sched(), 2000, 0) for r in ("prefill", "prefill", "decode"))
    cl = EngineClusterSpec(insts, RoutingConfig(topology="pd", block_size=BS), COST, BS, l3_bytes=0)
    reqs = [SimRequest(0.0, 8 * BS, 1, tuple(range(100, 108))), SimRequest(0.0, 8 * BS, 1, tuple(range(200, 208)))]
    own = EngineSimulator(cl, reqs).run()
    one = EngineSimulator(dataclasses.replace(cl, cores=1), reqs).run()
    assert {r["worker"] for r in own.rec} == {"prefill-0", "prefill-1"}
    d = COST.step_time_s([(8 * BS, 0)])
    assert _ttfts(own) == pytest.approx([d, d])
    assert _ttfts(one) == pytest.approx([2 * d, 2 * d])
    assert one.busy_s() == pytest.approx(own.busy_s())  # busy time is work, not wall


def test_request_overhead_is_instance_time_per_finished_prefill():
    insts = tuple(EngineInstanceSpec(r, COST, _sched(), 2000, 0) for r in ("prefill", "decode"))
    cl = EngineClusterSpec(insts, RoutingConfig(topology="pd", block_size=BS), COST, BS, l3_bytes=0,
                           request_overhead_s=0.25)
    reqs = [SimRequest(0.0, 4 * BS, 1, tuple(range(100, 104))), SimRequest(0.0, 4 * BS, 1, tuple(range(200, 204)))]
    sim = EngineSimulator(cl, reqs).run()
    d = COST.step_time_s([(4 * BS, 0)]) + 0.25  # the first arrival's step starts alone; the second waits
    assert _ttfts(sim) == pytest.approx([d, 2 * d])
    assert sum(sim.busy_s().values()) == pytest.approx(2 * d)


def test_a_write_through_is_visible_when_its_step_ends_not_when_it_starts():
    """pd-l3 with two prefill workers: B shares A's whole prefix and arrives while A's one-step
    prefill runs on p0, so it goes to the idle p1. The live connector stores A's blocks only after
    A's step, so B must recompute them (no L3 hit); a request arriving after A's step has ended
    finds them. (Written inside ``Engine.step()``, the blocks were visible at the step's start.)"""
    roles = ("prefill", "prefill", "decode")
    insts = tuple(EngineInstanceSpec(r, COST, _sched(), 2000, 0) for r in roles)
    cl = EngineClusterSpec(insts, RoutingConfig(topology="pd", block_size=BS, write_through="all"), COST, BS,
                           l3_bytes=100 << 30, kv_event_delay_s=0.0)
    prefix = tuple(range(100, 116))  # 16 blocks: one 8192-token step
    reqs = [SimRequest(0.0, 16 * BS, 2, prefix), SimRequest(0.001, 16 * BS + 100, 2, prefix + (900,)),
            SimRequest(5.0, 16 * BS + 200, 2, prefix + (901,))]
    sim = EngineSimulator(cl, reqs).run()
    a, b, c = sim.rec
    assert a["ttft_t"] - a["arrival"] > 0.01  # A's step takes time: B arrives during it
    assert b["worker"] != a["worker"]
    assert b["l3"] == 0 and b["l1"] == 0, b
    assert c["l1"] + c["l3"] >= 15 * BS, c
