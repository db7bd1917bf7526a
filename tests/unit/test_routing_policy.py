"""The pure routing policy (cpd.policy.routing): decisions as functions of snapshots."""
from __future__ import annotations

import pytest

from cpd.policy.routing import (LinearCostModel, NoWorkerError, PrefixMatch, Recompute, RoutingConfig, WorkerLoad,
                                plan_loads, route)
from cpd.types import RequestClass, Role, Tier

BS = 16
COST = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1000.0, l2_bytes_per_s=1e10,
                       l3_bytes_per_s=1e9, l3_overhead_s=1e-3)


def _workers(**queued) -> list[WorkerLoad]:
    return [WorkerLoad("pp0", "pre-prefill", queued.get("pp0", 0)), WorkerLoad("p0", "prefill", queued.get("p0", 0)),
            WorkerLoad("p1", "prefill", queued.get("p1", 0)), WorkerLoad("d0", "decode", running_requests=3),
            WorkerLoad("d1", "decode", running_requests=1)]


def test_cold_goes_to_pre_prefill_warm_to_prefill():
    cfg = RoutingConfig(topology="cpd", block_size=BS)
    cold = route(320, PrefixMatch(l3=2), _workers(), cfg, COST)
    assert (cold.request_class, cold.pool, cold.prefill_worker, cold.decode_worker) == ("cold", "pre-prefill", "pp0", "d1")
    warm = route(320, PrefixMatch(l3=15), _workers(), cfg, COST)
    assert (warm.request_class, warm.pool) == ("warm", "prefill")
    assert warm.load_plan.l3_blocks == 15 and warm.reuse_ratio == pytest.approx(15 * BS / 320)


def test_pd_topology_sends_everything_to_prefill_and_prefers_cache_holder():
    cfg = RoutingConfig(topology="pd", block_size=BS)
    d = route(320, PrefixMatch(l1={"p1": 18}), _workers(), cfg, COST)
    assert d.pool == "prefill" and d.prefill_worker == "p1" and d.load_plan.l1_blocks == 18
    cold = route(320, PrefixMatch(), _workers(p0=5000), cfg, COST)
    assert cold.pool == "prefill" and cold.prefill_worker == "p1"  # least loaded


def test_busy_cache_holder_loses_to_idle_worker_when_recompute_is_cheaper():
    cfg = RoutingConfig(topology="pd", block_size=BS)
    d = route(320, PrefixMatch(l1={"p0": 4}), _workers(p0=100_000), cfg, COST)
    assert d.prefill_worker == "p1"


def test_load_vs_recompute_cuts_a_slow_tier():
    cfg = RoutingConfig(block_size=BS)
    slow_l3 = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1e6, l3_bytes_per_s=1e6)
    plan, recompute = plan_loads("p0", PrefixMatch(l1={"p0": 2}, l3=10), 320, cfg, slow_l3)
    assert (plan.l1_blocks, plan.l3_blocks) == (2, 0) and recompute == Recompute(Tier.L3, 8)
    assert recompute.reason == "recompute-L3:8blk"  # the derived log string
    plan, recompute = plan_loads("p0", PrefixMatch(l1={"p0": 2}, l3=10), 320, cfg, COST)
    assert (plan.l1_blocks, plan.l3_blocks) == (2, 8) and recompute is None


def test_decision_carries_typed_outcomes_and_derives_its_reasons():
    """Control flow and metrics read typed fields; the reason strings are derived from them."""
    cfg = RoutingConfig(block_size=BS)
    slow_l3 = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1e6, l3_bytes_per_s=1e6)
    loads = [WorkerLoad("p0", Role.PREFILL), WorkerLoad("d0", Role.DECODE)]
    d = route(320, PrefixMatch(l1={"p0": 12}, l3=15), loads, cfg, slow_l3)
    assert d.request_class is RequestClass.WARM and d.pool is Role.PREFILL  # no pre-prefill pool: fallback
    assert d.recompute == Recompute(Tier.L3, 3) and d.load_plan.l3_blocks == 0
    assert d.fallback_from is None  # warm wants the prefill pool, which exists
    assert d.reasons == ("warm:reuse=0.60", "recompute-L3:3blk")
    cold = route(320, PrefixMatch(), loads, cfg, COST)
    assert cold.fallback_from is Role.PRE_PREFILL and cold.recompute is None
    assert cold.reasons == ("cold:reuse=0.00", "fallback:no-pre-prefill")
    assert f"{cold.pool}" == "prefill" and cold.pool == "prefill"  # str enums: labels and JSON unchanged


def test_tiers_combine_and_last_token_is_always_computed():
    cfg = RoutingConfig(block_size=BS)
    plan, _ = plan_loads("p0", PrefixMatch(l1={"p0": 3}, l2={"p0": 5}, l3=20), 160, cfg, COST)
    assert (plan.l1_blocks, plan.l2_blocks, plan.l3_blocks) == (3, 2, 4)  # capped at (160-1)//16 = 9 blocks


def test_fallbacks_and_errors():
    cfg = RoutingConfig(topology="cpd", block_size=BS)
    no_pre = [w for w in _workers() if w.role != "pre-prefill"]
    d = route(320, PrefixMatch(), no_pre, cfg, COST)
    assert d.pool == "prefill" and d.fallback_from == Role.PRE_PREFILL and "fallback:no-pre-prefill" in d.reasons
    with pytest.raises(NoWorkerError):
        route(320, PrefixMatch(), [WorkerLoad("d0", "decode")], cfg, COST)
    unhealthy = [WorkerLoad(w.worker_id, w.role, healthy=w.role == "decode") for w in _workers()]
    with pytest.raises(NoWorkerError):
        route(320, PrefixMatch(), unhealthy, cfg, COST)


def test_queue_priced_by_per_request_estimates_when_known():
    """With an attention term, pricing three queued 60K prefills as one 180K sequence overstates
    the queue; a caller that tracks per-request estimates passes their sum instead."""
    attn = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1e5, attn_coeff=1e-5)
    cfg = RoutingConfig(topology="pd", block_size=BS, waste_weight=0.0)  # TTFT alone decides here
    per_request = 3 * attn.prefill_time_s(60_000, 0)
    assert attn.prefill_time_s(180_000, 0) > per_request
    match = PrefixMatch(l1={"p0": 146_000 // BS})  # p0 holds 146K of the 150K prompt
    others = [WorkerLoad("p1", "prefill"), WorkerLoad("d0", "decode")]
    summed = WorkerLoad("p0", "prefill", queued_prefill_tokens=180_000, queued_prefill_s=per_request)
    assert route(150_000, match, [summed, *others], cfg, attn).prefill_worker == "p0"  # wait, then reuse
    one_long = WorkerLoad("p0", "prefill", queued_prefill_tokens=180_000)
    assert route(150_000, match, [one_long, *others], cfg, attn).prefill_worker == "p1"  # overstated queue


def test_decode_choice_counts_handoffs_still_under_way():
    """Rule 6: a decode worker with requests routed to it whose KV has not arrived yet is as loaded
    as one already decoding them; KV use only breaks ties between equal counts."""
    cfg = RoutingConfig(topology="pd", block_size=BS)
    loads = [WorkerLoad("p0", Role.PREFILL), WorkerLoad("d0", Role.DECODE, running_requests=1, kv_usage=0.9),
             WorkerLoad("d1", Role.DECODE, pending_handoffs=2, kv_usage=0.0)]
    assert route(320, PrefixMatch(), loads, cfg, COST).decode_worker == "d0"
    loads[1] = WorkerLoad("d0", Role.DECODE, running_requests=2, kv_usage=0.9)
    assert route(320, PrefixMatch(), loads, cfg, COST).decode_worker == "d1"  # 2 vs 2: lower KV use


def test_a_burst_spreads_over_the_decode_pool_before_any_kv_lands():
    """Requests routed one after another while every prefill still runs (no worker decodes yet,
    KV use equal): counting each routed request as a pending handoff spreads them evenly."""
    cfg = RoutingConfig(topology="pd", block_size=BS)
    pending = {f"d{i}": 0 for i in range(4)}
    for _ in range(10):
        loads = [WorkerLoad("p0", Role.PREFILL)] + [WorkerLoad(w, Role.DECODE, pending_handoffs=n)
                                                    for w, n in pending.items()]
        pending[route(320, PrefixMatch(), loads, cfg, COST).decode_worker] += 1
    assert sorted(pending.values()) == [2, 2, 3, 3]


def _decode_pool(assigned: dict[str, int]) -> list[WorkerLoad]:
    return [WorkerLoad("p0", Role.PREFILL)] + [WorkerLoad(w, Role.DECODE, running_requests=n)
                                               for w, n in assigned.items()]


def test_decode_worker_holding_the_prefix_wins_within_the_margin():
    """Rule 6 affinity: the decode worker whose L1 holds the prompt's prefix takes the request
    (its import moves only the rest) while, with it, it is at most ``decode_affinity_margin``
    assigned requests above the least-loaded worker; static and adaptive alike."""
    match = PrefixMatch(l1={"d1": 18})  # 288 of 320 tokens
    for mode in ("static", "adaptive"):
        cfg = RoutingConfig(topology="pd", block_size=BS, mode=mode, decode_affinity_margin=2)
        assert route(320, match, _decode_pool({"d0": 3, "d1": 4}), cfg, COST).decode_worker == "d1"
        assert route(320, match, _decode_pool({"d0": 3, "d1": 3}), cfg, COST).decode_worker == "d1"


def test_load_wins_over_the_prefix_beyond_the_margin():
    match = PrefixMatch(l1={"d1": 18})
    cfg = RoutingConfig(topology="pd", block_size=BS, decode_affinity_margin=2)
    assert route(320, match, _decode_pool({"d0": 3, "d1": 5}), cfg, COST).decode_worker == "d0"
    off = RoutingConfig(topology="pd", block_size=BS, decode_affinity_margin=-1)
    assert route(320, match, _decode_pool({"d0": 3, "d1": 4}), off, COST).decode_worker == "d0"


def test_a_short_or_common_prefix_does_not_pull_requests():
    """Affinity needs at least half the prompt more than the least-loaded worker holds: a shared
    system prompt held everywhere, or a short run, leaves the load order as it is."""
    cfg = RoutingConfig(topology="pd", block_size=BS, decode_affinity_margin=2)
    pool = _decode_pool({"d0": 3, "d1": 4, "d2": 4})
    assert route(320, PrefixMatch(l1={"d1": 9}), pool, cfg, COST).decode_worker == "d0"  # 144 of 320
    assert route(320, PrefixMatch(l1={"d0": 4, "d1": 12}), pool, cfg, COST).decode_worker == "d0"  # +8 blocks
    assert route(320, PrefixMatch(l1={"d0": 4, "d1": 14}), pool, cfg, COST).decode_worker == "d1"  # +10 blocks
    # two holders: the longest prefix, then the fewest assigned requests
    assert route(320, PrefixMatch(l1={"d1": 12, "d2": 18}), pool, cfg, COST).decode_worker == "d2"
    assert route(320, PrefixMatch(l1={"d1": 18, "d2": 18}), _decode_pool({"d0": 3, "d1": 4, "d2": 3}),
                 cfg, COST).decode_worker == "d2"


def test_without_a_holder_the_choice_is_the_least_loaded():
    cfg = RoutingConfig(topology="pd", block_size=BS, decode_affinity_margin=2)
    pool = _decode_pool({"d0": 2, "d1": 1})
    assert route(320, PrefixMatch(), pool, cfg, COST).decode_worker == "d1"
    assert route(320, PrefixMatch(l1={"p0": 18}), pool, cfg, COST).decode_worker == "d1"  # prefill L1 only
    unhealthy = [WorkerLoad("p0", Role.PREFILL), WorkerLoad("d0", Role.DECODE, running_requests=2),
                 WorkerLoad("d1", Role.DECODE, running_requests=1, healthy=False)]
    assert route(320, PrefixMatch(l1={"d1": 18}), unhealthy, cfg, COST).decode_worker == "d0"


def test_a_burst_on_one_held_prefix_still_spreads():
    """Requests sharing one long prefix held by d0 only, routed before any KV lands: d0 takes
    them until it is ``decode_affinity_margin`` above the others, then the pool shares them, so
    the spread never exceeds the margin."""
    cfg = RoutingConfig(topology="pd", block_size=BS, decode_affinity_margin=2)
    pending = {f"d{i}": 0 for i in range(4)}
    for _ in range(10):
        loads = [WorkerLoad("p0", Role.PREFILL)] + [WorkerLoad(w, Role.DECODE, pending_handoffs=n)
                                                    for w, n in pending.items()]
        pending[route(320, PrefixMatch(l1={"d0": 18}), loads, cfg, COST).decode_worker] += 1
        assert max(pending.values()) - min(pending.values()) <= 2
    assert pending == {"d0": 4, "d1": 2, "d2": 2, "d3": 2}


def test_write_through_defaults_follow_topology_and_mode():
    from cpd.types import RoutingMode, WriteThrough
    assert RoutingConfig(topology="pd").resolved_write_through() == WriteThrough.NONE
    assert RoutingConfig(topology="pd", mode=RoutingMode.ADAPTIVE).resolved_write_through() == WriteThrough.NONE
    assert RoutingConfig(topology="cpd").resolved_write_through() == WriteThrough.COLD
    assert RoutingConfig(topology="cpd", mode=RoutingMode.ADAPTIVE).resolved_write_through() == WriteThrough.ALL
    explicit = RoutingConfig(topology="cpd", mode=RoutingMode.ADAPTIVE, write_through=WriteThrough.COLD)
    assert explicit.resolved_write_through() == WriteThrough.COLD


@pytest.mark.parametrize("mode", ["static", "adaptive"])
def test_prefix_holder_keeps_a_turn_until_its_extra_queue_exceeds_twice_the_waste(mode):
    """Rule 5 / A1: a worker that would recompute the prefix pays its extra work twice (this
    request's TTFT and everyone's queued after it there). p1 holds 2,560 of 3,200 tokens (own
    0.64 s), p0 nothing (own 3.2 s, 2.56 s extra): with p1's queue 4 s longer the holder keeps the
    turn (TTFT alone would move it, 3.2 < 4.64 s, and split the session's prefix over two workers);
    6 s longer and it moves (5.76 < 6.64 s)."""
    topology = "pd" if mode == "static" else "cpd"
    match = PrefixMatch(l1={"p1": 2560 // BS})

    def chosen(extra_queue_s: float, **kw) -> str:
        cfg = RoutingConfig(topology=topology, block_size=BS, mode=mode, ttft_slo_s=10.0, **kw)
        loads = [WorkerLoad("pp0", "pre-prefill", queued_prefill_s=100.0),
                 WorkerLoad("p0", "prefill", queued_prefill_s=1.0),
                 WorkerLoad("p1", "prefill", queued_prefill_s=1.0 + extra_queue_s), WorkerLoad("d0", "decode")]
        d = route(3200, match, loads, cfg, COST)
        est = {c.worker_id: c for c in d.candidates}
        assert est["p0"].score - est["p0"].ttft_s == pytest.approx(cfg.waste_weight * 2.56)
        assert est["p1"].score == est["p1"].ttft_s  # the cheapest candidate wastes nothing
        return d.prefill_worker

    assert chosen(4.0) == "p1"
    assert chosen(6.0) == "p0"
    assert chosen(4.0, waste_weight=0.0) == "p0"
    assert chosen(2.0, waste_weight=0.0) == "p1"
