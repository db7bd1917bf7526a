"""Adaptive routing (issue 11, rules A1-A8 of cpd.policy.routing): pure decisions from snapshots."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.policy.routing import (DECODE_APPEND_TPOT_SHARE, HEAVY_SLO_SHARE, HOPELESS_WAIT_FACTOR, LARGE_SHORT_FACTOR,
                                MIN_DRAIN_SHARE,
                                SHORT_ARRIVAL_WINDOW_S,
                                SLO_PREDICTION_SHARE, ArrivalRate, DecisionReason, DispatchRates, LinearCostModel, NoWorkerError, Overloaded,
                                PrefixMatch, RouteDecision, RoutingConfig, WorkerLoad, heavy_uncached_s, route,
                                work_s)
from cpd.types import RequestClass, Role, RoutingMode, Topology, WriteThrough

BS = 16
# 1000 prompt tokens per second, L3 at 1 GB/s with 1 ms overhead, 1000 KV bytes per token:
# a block of 16 tokens computes in 16 ms and loads from L3 in 16 us (+1 ms per load).
COST = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1000.0, l2_bytes_per_s=1e10,
                       l3_bytes_per_s=1e9, l3_overhead_s=1e-3)
CFG = RoutingConfig(topology=Topology.CPD, block_size=BS, mode=RoutingMode.ADAPTIVE, ttft_slo_s=2.0)
HEAVY_TOKENS = 1600   # 1.6 s of own work on any worker (> heavy threshold 0.5 s, a quarter of the SLO)
SPILLABLE = 1200      # 1.2 s: heavy, but small enough to share the prefill pool when it must
SHORT_TOKENS = 3200   # with 3136 cached tokens: 64 new tokens, ~0.07 s


def _w(wid: str, role: Role, queued_s: float = 0.0, running: int = 0) -> WorkerLoad:
    return WorkerLoad(wid, role, running_requests=running, queued_prefill_s=queued_s)


def _cluster(pp=(0.0,), p=(0.0, 0.0), d=(0,)) -> list[WorkerLoad]:
    """Workers pp0.., p0.., d0.. with the given queued seconds (prefill side) / running requests (decode)."""
    return ([_w(f"pp{i}", Role.PRE_PREFILL, q) for i, q in enumerate(pp)]
            + [_w(f"p{i}", Role.PREFILL, q) for i, q in enumerate(p)]
            + [_w(f"d{i}", Role.DECODE, running=r) for i, r in enumerate(d)])


def _short_match(**l1) -> PrefixMatch:
    return PrefixMatch(l1=l1, l3=SHORT_TOKENS // BS - 4)


def _by_id(d: RouteDecision) -> dict[str, object]:
    return {c.worker_id: c for c in d.candidates}


def test_every_prefill_side_worker_is_a_candidate_with_its_estimate():
    d = route(SHORT_TOKENS, _short_match(p0=10), _cluster(pp=(0.3,), p=(0.2, 0.0)), CFG, COST)
    c = _by_id(d)
    assert set(c) == {"pp0", "p0", "p1"}
    for e in d.candidates:
        assert e.ttft_s == pytest.approx(e.wait_s + e.own_s) and e.delay_to_others_s == pytest.approx(e.own_s)
    assert c["pp0"].wait_s == 0.3 and c["p0"].wait_s == 0.2
    assert d.estimated_ttft_s == min(e.ttft_s for e in d.candidates if e.role == Role.PREFILL)


def test_heavy_work_goes_where_it_blocks_nobody():
    """A cold request goes to the pre-prefill pool although a prefill worker is as idle."""
    d = route(HEAVY_TOKENS, PrefixMatch(), _cluster(), CFG, COST)
    assert (d.request_class, d.pool, d.reason) == (RequestClass.COLD, Role.PRE_PREFILL, DecisionReason.HOME)
    assert d.write_through  # cpd default: heavy requests write through


def test_class_is_remaining_work_not_reuse_ratio():
    """90 % reuse of a 100K prompt still leaves 10K tokens (10 s) to compute: heavy."""
    n = 100_000
    d = route(n, PrefixMatch(l3=(n * 9 // 10) // BS), _cluster(), CFG, COST)
    assert d.reuse_ratio >= 0.9 and d.request_class == RequestClass.COLD and d.pool == Role.PRE_PREFILL
    small = route(300, PrefixMatch(), _cluster(), CFG, COST)  # 0 % reuse, 0.3 s of work: short
    assert small.reuse_ratio == 0 and small.request_class == RequestClass.WARM and small.pool == Role.PREFILL


def test_short_work_goes_where_it_finishes_first_within_home():
    d = route(SHORT_TOKENS, _short_match(), _cluster(pp=(0.5,), p=(0.4, 0.1)), CFG, COST)
    assert (d.pool, d.prefill_worker, d.reason) == (Role.PREFILL, "p1", DecisionReason.HOME)
    assert d.write_through  # adaptive mode writes every prefill through by default (rule A7)
    cold_only = dataclasses.replace(CFG, write_through=WriteThrough.COLD)
    assert not route(SHORT_TOKENS, _short_match(), _cluster(pp=(0.5,), p=(0.4, 0.1)), cold_only, COST).write_through


def test_hot_prefix_spreads_when_its_holder_is_saturated():
    """p0 holds the whole prefix in L1; p1 would load it from L3. Idle holder wins; a saturated
    holder loses to the worker that loads the prefix, which beats recomputing anywhere."""
    n = 3200
    match = PrefixMatch(l1={"p0": n // BS - 1}, l3=n // BS - 1)
    idle = route(n, match, _cluster(p=(0.0, 0.0)), CFG, COST)
    assert idle.prefill_worker == "p0" and idle.load_plan.l1_blocks == n // BS - 1
    busy = route(n, match, _cluster(p=(1.5, 0.0)), CFG, COST)
    assert busy.prefill_worker == "p1" and busy.load_plan.l3_blocks == n // BS - 1
    assert busy.request_class == RequestClass.WARM and busy.reason == DecisionReason.HOME


def test_hot_prefix_ten_concurrent_requests_spread_over_workers():
    """Ten concurrent requests on one hot prefix, the caller adding each estimate to the chosen
    worker's queue as the live dispatch does: they do not all queue on the holder."""
    n = 3200
    match = PrefixMatch(l1={"p0": n // BS - 1}, l3=n // BS - 1)
    queues = {"pp0": 0.0, "p0": 0.0, "p1": 0.0}
    for _ in range(10):
        d = route(n + 400, match, [_w(w, Role.PRE_PREFILL if w.startswith("pp") else Role.PREFILL, q)
                                   for w, q in queues.items()], CFG, COST)
        queues[d.prefill_worker] += _by_id(d)[d.prefill_worker].own_s
    assert sum(1 for q in queues.values() if q > 0) >= 2
    assert max(queues.values()) < 10 * 0.4  # not all ten on one worker


def test_short_work_spills_to_an_idle_pre_prefill_worker_when_it_finishes_clearly_first():
    """Short work needs no isolation: an idle pre-prefill worker takes it once it beats the prefill
    pool by more than the margin, SLO met or not; a smaller gain keeps it home (hysteresis)."""
    near = route(SHORT_TOKENS, _short_match(), _cluster(p=(0.01, 0.01)), CFG, COST)  # 0.078 vs 0.068 s
    assert near.pool == Role.PREFILL and near.reason == DecisionReason.HOME
    queued = route(SHORT_TOKENS, _short_match(), _cluster(p=(0.3, 0.3)), CFG, COST)  # 0.37 vs 0.07 s, SLO met
    assert (queued.pool, queued.prefill_worker, queued.reason) == (Role.PRE_PREFILL, "pp0", DecisionReason.SPILL_WARM)
    assert queued.request_class == RequestClass.WARM and queued.write_through


def test_short_work_pays_the_spill_margin_only_while_home_meets_the_slo():
    """The margin keeps short work home only while that costs no SLO: with the prefill pool's best
    at 2.42 s (SLO 2 s), a pre-prefill worker at 1.92 s (within the 25 % margin) takes it; at
    1.57 s home vs 1.27 s (home meets the SLO) the hysteresis holds. Heavy work keeps the margin:
    its spill would delay the prefill pool's short work."""
    miss = route(SHORT_TOKENS, _short_match(), _cluster(pp=(1.85,), p=(2.35, 2.35)), CFG, COST)
    c = _by_id(miss)
    assert c["p0"].ttft_s > CFG.ttft_slo_s
    assert (1 - CFG.spill_margin) * c["p0"].ttft_s < c["pp0"].ttft_s < c["p0"].ttft_s
    assert (miss.pool, miss.prefill_worker, miss.reason) == (Role.PRE_PREFILL, "pp0", DecisionReason.SPILL_WARM)
    assert miss.estimated_ttft_s == pytest.approx(c["pp0"].ttft_s)
    meets = route(SHORT_TOKENS, _short_match(), _cluster(pp=(1.2,), p=(1.5, 1.5)), CFG, COST)
    c = _by_id(meets)
    assert c["p0"].ttft_s <= CFG.ttft_slo_s and (1 - CFG.spill_margin) * c["p0"].ttft_s < c["pp0"].ttft_s
    assert (meets.pool, meets.reason) == (Role.PREFILL, DecisionReason.HOME)
    heavy = route(SPILLABLE, PrefixMatch(), _cluster(pp=(1.2,), p=(0.8,)), CFG, COST)  # 2.4 s home vs 2.0 s
    c = _by_id(heavy)
    assert c["pp0"].ttft_s > CFG.ttft_slo_s and (1 - CFG.spill_margin) * c["pp0"].ttft_s < c["p0"].ttft_s
    assert (heavy.request_class, heavy.pool, heavy.reason) == (RequestClass.COLD, Role.PRE_PREFILL, DecisionReason.HOME)


def test_heavy_work_stays_home_while_it_meets_the_slo():
    d = route(SPILLABLE, PrefixMatch(), _cluster(pp=(0.2,), p=(0.0, 0.0)), CFG, COST)  # 1.4 s at home vs 1.2 s
    assert d.pool == Role.PRE_PREFILL and d.reason == DecisionReason.HOME


def test_heavy_work_stays_home_only_while_home_meets_the_slo_with_the_estimates_error_allowed_for():
    """Rule A3's stay-home test for heavy work is ``ttft_s <= SLO_PREDICTION_SHARE * ttft_slo_s``,
    not ``<= ttft_slo_s``: the router's TTFT prediction is off by up to a third (p95 actual /
    predicted 1.24-1.34 on the modeled-ordering workload), so a prediction just under the SLO is a
    coin toss. Heavy work predicted at 1.9 s at home (SLO 2 s) with an idle prefill worker at
    1.2 s spills (held home, such requests missed the SLO 8 times in 31 and set adaptive below
    P/D); at 1.52 s home vs 1.2 s it still needs the margin and stays. Short work keeps the plain
    SLO test for its margin: at 1.80 s home vs 1.60 s it stays home."""
    assert SLO_PREDICTION_SHARE * CFG.ttft_slo_s < 1.52
    heavy = route(SPILLABLE, PrefixMatch(), _cluster(pp=(0.7,), p=(0.0, 0.0)), CFG, COST)
    c = _by_id(heavy)
    assert SLO_PREDICTION_SHARE * CFG.ttft_slo_s < c["pp0"].ttft_s <= CFG.ttft_slo_s
    assert (heavy.request_class, heavy.pool, heavy.reason) == (RequestClass.COLD, Role.PREFILL,
                                                               DecisionReason.SPILL_COLD)
    assert heavy.estimated_ttft_s == pytest.approx(1.2)
    near = route(SPILLABLE, PrefixMatch(), _cluster(pp=(0.32,), p=(0.0, 0.0)), CFG, COST)  # 1.52 vs 1.2 s
    assert (near.pool, near.reason) == (Role.PRE_PREFILL, DecisionReason.HOME)
    short = route(SHORT_TOKENS, _short_match(), _cluster(pp=(1.53,), p=(1.73, 1.73)), CFG, COST)
    c = _by_id(short)
    assert SLO_PREDICTION_SHARE * CFG.ttft_slo_s < c["p0"].ttft_s <= CFG.ttft_slo_s
    assert (1 - CFG.spill_margin) * c["p0"].ttft_s < c["pp0"].ttft_s < c["p0"].ttft_s
    assert (short.pool, short.reason) == (Role.PREFILL, DecisionReason.HOME)


def test_heavy_work_spills_to_the_prefill_pool_only_if_short_work_still_fits():
    """Pre-prefill saturated: heavy work takes a prefill worker when the prefill pool keeps a worker
    whose queue stays within the SLO; with one prefill worker whose queue it would push past the
    SLO it stays home."""
    two = route(SPILLABLE, PrefixMatch(), _cluster(pp=(8.0,), p=(0.5, 0.0)), CFG, COST)
    assert (two.pool, two.prefill_worker, two.reason) == (Role.PREFILL, "p1", DecisionReason.SPILL_COLD)
    assert two.request_class == RequestClass.COLD and two.write_through  # cold writes through wherever it runs
    one = route(1800, PrefixMatch(), _cluster(pp=(8.0,), p=(0.5,)), CFG, COST)  # 0.5 + 1.8 > 2
    assert one.pool == Role.PRE_PREFILL and one.reason == DecisionReason.HOME
    small = route(SPILLABLE, PrefixMatch(), _cluster(pp=(8.0,), p=(0.5,)), CFG, COST)  # 0.5 + 1.2 <= 2
    assert small.pool == Role.PREFILL and small.reason == DecisionReason.SPILL_COLD


def test_work_longer_than_the_slo_takes_an_idle_prefill_worker_past_a_hopeless_home_queue():
    """A request whose own work (3 s) exceeds the SLO (2 s) misses it anywhere by the estimate: it
    stays home behind a queue of up to HOPELESS_WAIT_FACTOR x its own work (6 s), then takes a
    prefill worker with nothing queued (it stayed behind a pre-prefill queue of any length while the
    prefill worker idled), never a busy one."""
    assert HOPELESS_WAIT_FACTOR * 3.0 == 6.0
    hopeless = route(3000, PrefixMatch(), _cluster(pp=(13.0,), p=(0.0,)), CFG, COST)
    assert (hopeless.pool, hopeless.prefill_worker, hopeless.reason) == (Role.PREFILL, "p0",
                                                                        DecisionReason.SPILL_COLD)
    for pp_q, p_q in ((5.0, 0.0), (13.0, 0.5), (600.0, 0.5), (0.0, 0.0)):
        d = route(3000, PrefixMatch(), _cluster(pp=(pp_q,), p=(p_q,)), CFG, COST)
        assert d.pool == Role.PRE_PREFILL and d.reason == DecisionReason.HOME, (pp_q, p_q)


def test_work_priced_over_the_slo_leaves_a_home_queue_of_twice_its_own_work_for_an_idle_prefill_worker():
    """The estimate is not the request's time (a router model fitted to warm turns prices cold
    prompts at 1.5-3x their compute), so a request priced at 3 s against a 2 s SLO may meet it on
    an idle worker: it takes an idle prefill worker once home would make it wait more than twice
    its own work (7 s here; at the earlier factor of 4 it waited up to 12 s at home)."""
    d = route(3000, PrefixMatch(), _cluster(pp=(7.0,), p=(0.0,)), CFG, COST)
    assert (d.pool, d.prefill_worker, d.reason) == (Role.PREFILL, "p0", DecisionReason.SPILL_COLD)


def test_float_residue_of_a_running_queue_sum_is_nothing_queued():
    """The live router and the simulator keep queued_prefill_s as a running sum (+ at dispatch, - at
    the first token); an idle worker is left with float residue (1.5e-16 s in the simulator). The
    hopeless spill of the test above needs a prefill worker with nothing queued: the residue must
    not refuse it (it did wherever the residue was positive: the request stayed home)."""
    for residue in (1.5e-16, 1e-12, -1e-12):
        ws = [_w("pp0", Role.PRE_PREFILL, 13.0), _w("p0", Role.PREFILL, residue), _w("d0", Role.DECODE)]
        d = route(3000, PrefixMatch(), ws, CFG, COST)
        assert (d.pool, d.prefill_worker, d.reason) == (Role.PREFILL, "p0", DecisionReason.SPILL_COLD), residue
    busy = route(3000, PrefixMatch(), [_w("pp0", Role.PRE_PREFILL, 13.0), _w("p0", Role.PREFILL, 1e-3),
                                       _w("d0", Role.DECODE)], CFG, COST)
    assert (busy.pool, busy.reason) == (Role.PRE_PREFILL, DecisionReason.HOME)


def test_work_longer_than_the_slo_spills_only_where_it_pushes_less_than_one_short_request_past_the_slo():
    """The hopeless spill above gains no goodput (3 s of own work misses a 2 s SLO anywhere), and
    on the only prefill worker it holds every short request arriving in its first 3 - 0.75 x 2 =
    1.5 s past the SLO with the estimate's error allowed for (short work of no measured size,
    nothing else busy). It spills while the prefill pool's measured short arrivals make that less
    than one request (0.5/s: 0.75), and stays home at 1/s (1.5 requests) or 2/s (a rate of 0, no
    short traffic, is the case above)."""
    def route_with(rate: float) -> RouteDecision:
        ws = [_w("pp0", Role.PRE_PREFILL, 13.0), _w("d0", Role.DECODE),
              dataclasses.replace(_w("p0", Role.PREFILL), short_arrivals_per_s=rate)]
        return route(3000, PrefixMatch(), ws, CFG, COST)

    spilled = route_with(0.5)
    assert (spilled.pool, spilled.prefill_worker, spilled.reason) == (Role.PREFILL, "p0", DecisionReason.SPILL_COLD)
    for rate in (1.0, 2.0):
        d = route_with(rate)
        assert (d.pool, d.reason) == (Role.PRE_PREFILL, DecisionReason.HOME), rate


def test_arrival_rate_counts_the_last_window():
    r = ArrivalRate(window_s=10.0)
    for t, work in ((0.0, 0.1), (1.0, 0.2), (2.0, 0.3), (9.0, 0.4)):
        r.observe(t, work)
    assert r.per_s(9.0) == pytest.approx(0.4) and r.work_per_s(9.0) == pytest.approx(0.1)
    assert r.per_s(11.5) == pytest.approx(0.2)   # the events at 2 and 9 s are within [1.5, 11.5]
    assert r.work_per_s(11.5) == pytest.approx(0.07)
    assert r.per_s(30.0) == 0.0 and r.work_per_s(30.0) == 0.0
    assert ArrivalRate().window_s == SHORT_ARRIVAL_WINDOW_S


def test_dispatch_rates_count_each_class_apart_as_the_snapshot_reads_them():
    """A worker's dispatches split by class into short and heavy rates (what the live router and the
    simulator put into ``WorkerLoad``): two short dispatches of 0.1 s and one heavy of 1 s in a 10 s
    window are 0.2/s and 0.02 s/s short, 0.1/s and 0.1 s/s heavy; the fields build a WorkerLoad."""
    r = DispatchRates(window_s=10.0)
    r.observe(0.0, RequestClass.WARM, 0.1)
    r.observe(1.0, RequestClass.COLD, 1.0)
    r.observe(2.0, RequestClass.WARM, 0.1)
    f = r.load_fields(2.0)
    assert f == pytest.approx({"short_arrivals_per_s": 0.2, "short_work_per_s": 0.02,
                               "heavy_arrivals_per_s": 0.1, "heavy_work_per_s": 0.1})
    assert WorkerLoad("p0", Role.PREFILL, **f).heavy_work_per_s == pytest.approx(0.1)
    assert r.load_fields(30.0) == {k: 0.0 for k in f}


def _heavy_spill_with_short_traffic(prefill_queue_s: float, rate: float, work_per_s: float) -> RouteDecision:
    """SPILLABLE (1.2 s of own work) against a saturated pre-prefill worker (8 s queued) and the only
    prefill worker, whose short dispatches arrive at ``rate`` per second with ``work_per_s``."""
    ws = [_w("pp0", Role.PRE_PREFILL, 8.0), _w("d0", Role.DECODE),
          dataclasses.replace(_w("p0", Role.PREFILL, prefill_queue_s), short_arrivals_per_s=rate,
                              short_work_per_s=work_per_s)]
    return route(SPILLABLE, PrefixMatch(), ws, CFG, COST)


def test_heavy_spill_within_the_slo_is_priced_by_the_short_work_it_holds_past_the_slo():
    """A heavy spill that meets its own SLO on the only prefill worker (0.5 + 1.2 = 1.7 s <= 2 s) still
    holds the short work arriving behind it: short turns of 0.1 s meet the SLO with the estimate's
    error allowed for behind at most 0.75 x 2 - 0.1 = 1.4 s of queue, so the spill leaves 0.3 s of
    excess, which drains at 1 - busy per second while short requests keep arriving. At 1/s (10 %
    busy: 0.33 expected misses) it spills; at 5/s (50 % busy: 3 misses for the one request it saves)
    it stays home (the rule before session 20 spilled whenever the queue stayed within the SLO:
    session 19's agent misses). Within the error allowance it spills at any rate."""
    assert SLO_PREDICTION_SHARE * CFG.ttft_slo_s - 0.1 == pytest.approx(1.4)
    light = _heavy_spill_with_short_traffic(0.5, 1.0, 0.1)
    assert (light.pool, light.prefill_worker, light.reason) == (Role.PREFILL, "p0", DecisionReason.SPILL_COLD)
    busy = _heavy_spill_with_short_traffic(0.5, 5.0, 0.5)
    assert (busy.pool, busy.reason) == (Role.PRE_PREFILL, DecisionReason.HOME)
    within = _heavy_spill_with_short_traffic(0.2, 5.0, 0.5)  # 0.2 + 1.2 = 1.4 s: no excess
    assert (within.pool, within.reason) == (Role.PREFILL, DecisionReason.SPILL_COLD)


def test_the_price_of_a_heavy_spill_grows_as_short_work_fills_the_worker():
    """The same excess (0.3 s past the bound 1.5 s - mean short work) and the same short rate (2/s:
    0.6 requests if the excess drained at once) cost more misses the busier short work keeps the
    worker, which drains the excess at 1 - busy per second: 20 % busy, 0.75 misses, it spills; 50 %
    busy, 1.2, it stays home. A worker that short work fills entirely drains at MIN_DRAIN_SHARE
    (0.1 s per second), not never: 10/s at 100 % busy prices 5 ms of excess at 0.5 misses."""
    assert MIN_DRAIN_SHARE == 0.1
    for work_per_s, spills in ((0.2, True), (1.0, False)):
        mean = work_per_s / 2.0
        queue = 0.3 + (SLO_PREDICTION_SHARE * CFG.ttft_slo_s - mean) - 1.2  # lowest queue = bound + 0.3
        d = _heavy_spill_with_short_traffic(queue, 2.0, work_per_s)
        assert (d.pool == Role.PREFILL) is spills, work_per_s
    for excess, spills in ((0.005, True), (0.02, False)):
        d = _heavy_spill_with_short_traffic(0.2 + excess, 10.0, 1.0)  # bound 1.4 s, busy 1.0
        assert (d.pool == Role.PREFILL) is spills, excess


def test_a_heavy_spill_is_priced_by_the_short_work_it_holds_only():
    """The spill refused above (1.2 s onto a prefill worker whose short work it would push 3 requests
    past the SLO) stays refused however busy home is with heavy arrivals (priced both ways, with
    home's arrivals as a saving, it spilled more where home is congested and lost 3 agent seeds
    12-23 %, session 21), and heavy arrivals in the prefill pool do not add to its price (the light
    case still spills)."""
    def route_with(home_rate: float, home_work_per_s: float, pool_heavy_rate: float) -> RouteDecision:
        ws = [dataclasses.replace(_w("pp0", Role.PRE_PREFILL, 8.0), heavy_arrivals_per_s=home_rate,
                                  heavy_work_per_s=home_work_per_s), _w("d0", Role.DECODE),
              dataclasses.replace(_w("p0", Role.PREFILL, 0.5), short_arrivals_per_s=5.0 if home_rate else 1.0,
                                  short_work_per_s=0.5 if home_rate else 0.1, heavy_arrivals_per_s=pool_heavy_rate,
                                  heavy_work_per_s=pool_heavy_rate)]
        return route(SPILLABLE, PrefixMatch(), ws, CFG, COST)

    for home_rate, work in ((1.0, 0.8), (0.1, 0.1)):
        d = route_with(home_rate, work, 0.0)
        assert (d.pool, d.reason) == (Role.PRE_PREFILL, DecisionReason.HOME), home_rate
    light = route_with(0.0, 0.0, 0.5)  # 1 short/s at 10 % busy (0.33 misses), heavy spills there too
    assert (light.pool, light.prefill_worker, light.reason) == (Role.PREFILL, "p0", DecisionReason.SPILL_COLD)


def _short_with_congested_prefill(num_new_tokens: int, prefill_queue_s: float) -> RouteDecision:
    """A short request (``num_new_tokens`` past a 3136-token cached prefix) against the only prefill
    worker, ``prefill_queue_s`` queued, short work arriving at 8/s and keeping it 70 % busy (mean
    estimate 0.0875 s, bound 0.75 x 2 - 0.0875 = 1.4125 s), and a pre-prefill worker 3 s behind with
    no measured arrivals."""
    ws = [_w("pp0", Role.PRE_PREFILL, 3.0), _w("d0", Role.DECODE),
          dataclasses.replace(_w("p0", Role.PREFILL, prefill_queue_s), short_arrivals_per_s=8.0,
                              short_work_per_s=0.7)]
    return route(3136 + num_new_tokens, PrefixMatch(l1={"p0": 196, "pp0": 196}), ws, CFG, COST)


def test_a_large_short_request_leaves_a_congested_prefill_pool_where_it_costs_fewer_misses():
    """Short work may leave home without a faster TTFT: on a prefill worker past its bound a short
    request of 0.4 s (4.6x the mean short estimate: large) meets its own SLO (1.5 + 0.4 < 2 s) but
    holds the turns arriving in the next 0.4 / 0.3 s past it (8/s: ~10.7 requests); on the
    pre-prefill worker it misses (3.4 s), which costs one. It goes there (``spill-warm``). Below the
    bound (0.8 s queued: 1.2 s with it) it costs nothing at home and stays. A typical turn of 0.064 s
    (under LARGE_SHORT_FACTOR x the mean) stays although the price alone would move it (it takes a
    queue of 1.4 s past the bound: 8 x 0.0515 / 0.3 = 1.37 held > 1 at the other pool)."""
    assert 0.4 > LARGE_SHORT_FACTOR * 0.7 / 8.0 > 0.064
    d = _short_with_congested_prefill(400, 1.5)
    assert d.request_class == RequestClass.WARM
    assert (d.pool, d.prefill_worker, d.reason) == (Role.PRE_PREFILL, "pp0", DecisionReason.SPILL_WARM)
    assert d.estimated_ttft_s > CFG.ttft_slo_s
    calm = _short_with_congested_prefill(400, 0.8)
    assert (calm.pool, calm.reason) == (Role.PREFILL, DecisionReason.HOME)
    turn = _short_with_congested_prefill(64, 1.4)
    assert (turn.pool, turn.reason) == (Role.PREFILL, DecisionReason.HOME)


@settings(max_examples=300, deadline=None)
@given(home_q=st.floats(0, 20), other_q=st.floats(0, 20), extra=st.floats(0, 5), heavy=st.booleans(),
       rates=st.tuples(st.floats(0, 20), st.floats(0, 1.5), st.floats(0, 20), st.floats(0, 1.5)))
def test_a_priced_spill_is_monotone_in_the_home_queue(home_q, other_q, extra, heavy, rates):
    """With measured arrivals on both pools (the price active both ways) a longer home queue still
    never turns a spill back home."""
    n, match = (SPILLABLE, PrefixMatch()) if heavy else (SHORT_TOKENS, _short_match())
    home, other = (Role.PRE_PREFILL, Role.PREFILL) if heavy else (Role.PREFILL, Role.PRE_PREFILL)
    hr, hw, orate, ow = rates

    def pool(q: float) -> Role:
        ws = [dataclasses.replace(_w("h", home, q), short_arrivals_per_s=hr, short_work_per_s=hw),
              dataclasses.replace(_w("o", other, other_q), short_arrivals_per_s=orate, short_work_per_s=ow),
              _w("d0", Role.DECODE)]
        return route(n, match, ws, CFG, COST).pool

    if pool(home_q) == other:
        assert pool(home_q + extra) == other


@settings(max_examples=300, deadline=None)
@given(home_q=st.floats(0, 20), other_q=st.floats(0, 20), heavy=st.booleans())
def test_spill_needs_more_than_the_margin_and_heavy_work_a_missed_slo(home_q, other_q, heavy):
    n, match = (SPILLABLE, PrefixMatch()) if heavy else (SHORT_TOKENS, _short_match())
    home, other = (Role.PRE_PREFILL, Role.PREFILL) if heavy else (Role.PREFILL, Role.PRE_PREFILL)
    ws = [_w("h", home, home_q), _w("o", other, other_q), _w("o2", other, other_q), _w("d0", Role.DECODE)]
    d = route(n, match, ws, CFG, COST)
    c = _by_id(d)
    spilled = d.reason in (DecisionReason.SPILL_COLD, DecisionReason.SPILL_WARM)
    assert spilled == (d.pool == other)
    # short work whose home misses the SLO spills for any gain (rule A3), else for more than the
    # margin; heavy work spills only once home's prediction exceeds SLO_PREDICTION_SHARE x the SLO
    margin = 0.0 if (not heavy and c["h"].ttft_s > CFG.ttft_slo_s) else CFG.spill_margin
    if spilled:
        assert c["h"].ttft_s > SLO_PREDICTION_SHARE * CFG.ttft_slo_s or not heavy
        assert d.estimated_ttft_s < (1 - margin) * c["h"].ttft_s
    elif not heavy:
        assert c["o"].ttft_s >= (1 - margin) * c["h"].ttft_s


@settings(max_examples=200, deadline=None)
@given(home_q=st.floats(0, 20), other_q=st.floats(0, 20), extra=st.floats(0, 5), heavy=st.booleans())
def test_spill_is_monotone_in_the_home_queue(home_q, other_q, extra, heavy):
    """No flapping from the decision itself: a longer home queue never turns a spill back home."""
    n, match = (SPILLABLE, PrefixMatch()) if heavy else (SHORT_TOKENS, _short_match())
    home, other = (Role.PRE_PREFILL, Role.PREFILL) if heavy else (Role.PREFILL, Role.PRE_PREFILL)

    def pool(q: float) -> Role:
        ws = [_w("h", home, q), _w("o", other, other_q), _w("o2", other, other_q)]
        return route(n, match, ws, CFG, COST).pool

    if pool(home_q) == other:
        assert pool(home_q + extra) == other


def _replay(kinds: str, gap_s: float, queues: dict[str, float], cfg: RoutingConfig = CFG):
    """Scripted steady load: one request every ``gap_s``; the caller adds the chosen worker's
    own work to its queue (as the live dispatch does) and every queue drains at 1 s/s."""
    decisions = []
    for i in range(len(kinds)):
        for w in queues:
            queues[w] = max(0.0, queues[w] - gap_s)
        n, match = (SPILLABLE, PrefixMatch()) if kinds[i] == "h" else (SHORT_TOKENS, _short_match())
        ws = [_w(w, Role.PRE_PREFILL if w.startswith("pp") else Role.PREFILL, q) for w, q in queues.items()]
        d = route(n, match, ws, cfg, COST)
        queues[d.prefill_worker] += _by_id(d)[d.prefill_worker].own_s
        decisions.append(d)
    return decisions


def test_steady_sustainable_load_never_spills():
    """Heavy work (1.2 s each) every 2.5 s on pre-prefill, short work (0.07 s) in between: both pools
    keep up, so every decision after the first is HOME, whatever the queues do in between."""
    ds = _replay("hssss" * 40, 0.5, {"pp0": 0.0, "p0": 0.0, "p1": 0.0})
    assert all(d.reason == DecisionReason.HOME for d in ds)
    assert {d.pool for d in ds if d.request_class == RequestClass.COLD} == {Role.PRE_PREFILL}


def test_steady_overload_settles_into_a_fixed_pattern():
    """Heavy work at 1.25x the pre-prefill capacity: spilling absorbs the excess; queues stay
    bounded and the spill share settles (the same in every later window) instead of swinging."""
    ds = _replay("h" * 400, 0.96, {"pp0": 0.0, "p0": 0.0, "p1": 0.0})
    spills = [d.reason == DecisionReason.SPILL_COLD for d in ds]
    windows = [sum(spills[i:i + 50]) for i in range(100, 400, 50)]
    assert max(windows) - min(windows) <= 2 and 0 < windows[0] < 50
    assert max(d.estimated_ttft_s for d in ds[100:]) < 2 * CFG.ttft_slo_s


def test_pd_topology_scores_remaining_work_without_spill():
    cfg = dataclasses.replace(CFG, topology=Topology.PD, write_through=None)
    ws = [_w("p0", Role.PREFILL, 5.0), _w("p1", Role.PREFILL, 1.0), _w("d0", Role.DECODE)]
    d = route(HEAVY_TOKENS, PrefixMatch(), ws, cfg, COST)
    assert (d.pool, d.prefill_worker, d.reason) == (Role.PREFILL, "p1", DecisionReason.HOME)
    assert not d.write_through  # pd default: none


def test_empty_home_pool_falls_back():
    ws = [_w("p0", Role.PREFILL), _w("d0", Role.DECODE)]
    d = route(HEAVY_TOKENS, PrefixMatch(), ws, CFG, COST)
    assert (d.pool, d.reason, d.fallback_from) == (Role.PREFILL, DecisionReason.FALLBACK, Role.PRE_PREFILL)
    with pytest.raises(NoWorkerError):
        route(HEAVY_TOKENS, PrefixMatch(), [_w("d0", Role.DECODE)], CFG, COST)


def test_write_through_all_writes_every_request():
    cfg = dataclasses.replace(CFG, write_through=WriteThrough.ALL)
    assert route(SHORT_TOKENS, _short_match(), _cluster(), cfg, COST).write_through
    cfg = dataclasses.replace(CFG, write_through=WriteThrough.NONE)
    assert not route(HEAVY_TOKENS, PrefixMatch(), _cluster(), cfg, COST).write_through


# -- decode-local append (A4) ---------------------------------------------------------------------

APPEND_CFG = dataclasses.replace(CFG, decode_append_max_tokens=64, tpot_slo_s=0.1)


def _append_match(decode_blocks: int) -> PrefixMatch:
    return PrefixMatch(l1={"d1": decode_blocks}, l3=decode_blocks)


def test_decode_append_when_small_and_tpot_holds():
    n = 100 * BS + 30  # 30 uncached tokens: 30 ms of compute, within half the 100 ms TPOT SLO
    d = route(n, _append_match(100), _cluster(p=(0.5, 0.5), d=(0, 5)), APPEND_CFG, COST)
    assert (d.pool, d.prefill_worker, d.decode_worker, d.reason) == (Role.DECODE, "d1", "d1",
                                                                      DecisionReason.DECODE_APPEND)
    assert d.decode_append and d.load_plan.l1_blocks == 100 and d.request_class == RequestClass.WARM
    assert d.estimated_ttft_s == pytest.approx(0.03)
    assert _by_id(d)["d1"].role == Role.DECODE


def test_decode_append_refused_when_too_long_or_tpot_breaks_or_off():
    n = 100 * BS + 30
    big = route(100 * BS + 80, _append_match(100), _cluster(p=(0.5,)), APPEND_CFG, COST)  # 80 > 64 tokens
    assert big.pool != Role.DECODE and big.decode_worker == "d0"
    slow = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=500.0)  # 60 ms > 50 ms
    assert 30 / 500 > DECODE_APPEND_TPOT_SHARE * APPEND_CFG.tpot_slo_s
    assert route(n, _append_match(100), _cluster(p=(0.5,)), APPEND_CFG, slow).pool != Role.DECODE
    off = dataclasses.replace(APPEND_CFG, decode_append_max_tokens=0)
    assert route(n, _append_match(100), _cluster(p=(0.5,)), off, COST).pool != Role.DECODE


def test_decode_append_only_when_it_beats_the_prefill_side():
    n = 100 * BS + 30
    match = PrefixMatch(l1={"d0": 100, "p0": 100}, l3=100)  # p0 holds it too and is idle
    ws = [_w("pp0", Role.PRE_PREFILL), _w("p0", Role.PREFILL), WorkerLoad("d0", Role.DECODE, queued_prefill_s=0.01)]
    d = route(n, match, ws, APPEND_CFG, COST)
    assert Role.DECODE in {c.role for c in d.candidates}  # 0.01 + 0.03 s fits the TPOT share
    assert d.pool == Role.PREFILL and d.prefill_worker == "p0"  # 0.03 s beats 0.01 s of queued appends + 0.03 s
    # no decode worker holds it: no append candidate at all
    d = route(n, PrefixMatch(l3=100), _cluster(), APPEND_CFG, COST)
    assert all(c.role != Role.DECODE for c in d.candidates)


# -- read-after-write (A5) ------------------------------------------------------------------------

RAW_CFG = dataclasses.replace(CFG, raw_wait_max_s=1.0)


def test_read_after_write_waits_when_faster():
    """3000 of 3200 tokens are being written through, visible in 0.2 s: waiting + loading (~0.4 s)
    beats recomputing them (3.2 s)."""
    match = PrefixMatch(l3=0, l3_pending=3000 // BS, l3_pending_ready_s=0.2)
    d = route(3200, match, _cluster(), RAW_CFG, COST)
    assert d.reason == DecisionReason.WAIT_FOR_L3 and d.wait_for_l3_s == 0.2
    assert d.load_plan.l3_blocks == 3000 // BS
    assert d.request_class == RequestClass.WARM and d.pool == Role.PREFILL  # short once the prefix loads
    assert d.estimated_ttft_s == pytest.approx(0.2 + min(c.own_s for c in d.candidates))
    assert all(c.wait_s >= 0.2 for c in d.candidates)


def test_read_after_write_recomputes_when_waiting_is_slower_or_too_long():
    few = PrefixMatch(l3=0, l3_pending=2, l3_pending_ready_s=0.5)  # 32 tokens: recompute 32 ms < 0.5 s wait
    d = route(3200, few, _cluster(), RAW_CFG, COST)
    assert d.reason != DecisionReason.WAIT_FOR_L3 and d.wait_for_l3_s == 0 and d.load_plan.l3_blocks == 0
    late = PrefixMatch(l3=0, l3_pending=3000 // BS, l3_pending_ready_s=1.5)  # beyond raw_wait_max_s
    assert route(3200, late, _cluster(), RAW_CFG, COST).wait_for_l3_s == 0
    off = dataclasses.replace(RAW_CFG, raw_wait_max_s=0.0)
    near = PrefixMatch(l3=0, l3_pending=3000 // BS, l3_pending_ready_s=0.1)
    assert route(3200, near, _cluster(), off, COST).wait_for_l3_s == 0


@settings(max_examples=200, deadline=None)
@given(pending=st.integers(0, 199), ready=st.floats(0, 2), visible=st.integers(0, 199))
def test_read_after_write_waits_only_when_predicted_faster(pending, ready, visible):
    match = PrefixMatch(l3=visible, l3_pending=pending, l3_pending_ready_s=ready)
    d = route(3200, match, _cluster(), RAW_CFG, COST)
    now = route(3200, dataclasses.replace(match, l3_pending=0), _cluster(), RAW_CFG, COST)
    if d.wait_for_l3_s > 0:
        assert d.wait_for_l3_s <= RAW_CFG.raw_wait_max_s and pending > visible
        assert d.estimated_ttft_s < now.estimated_ttft_s
    else:
        assert d == now


# -- admission (A6) --------------------------------------------------------------------------------

ADMIT_CFG = dataclasses.replace(CFG, admission_factor=2.0)


def test_admission_rejects_when_every_candidate_is_far_over_the_slo():
    with pytest.raises(Overloaded) as e:
        route(SHORT_TOKENS, _short_match(), _cluster(pp=(9.0,), p=(6.0, 5.0)), ADMIT_CFG, COST)
    best = 5.0 + 0.064 + 0.001 + 0.0032  # p1: queue + compute 64 tokens + L3 load
    assert e.value.predicted_ttft_s == pytest.approx(best, rel=1e-2)
    assert e.value.retry_after_s == pytest.approx(best - ADMIT_CFG.ttft_slo_s, rel=1e-2)
    assert 0 < e.value.retry_after_s < e.value.predicted_ttft_s


def test_admission_admits_when_one_candidate_is_within_the_bound_or_factor_unset():
    route(SHORT_TOKENS, _short_match(), _cluster(pp=(9.0,), p=(6.0, 3.5)), ADMIT_CFG, COST)  # 3.57 < 4
    route(SHORT_TOKENS, _short_match(), _cluster(pp=(90.0,), p=(60.0, 50.0)), CFG, COST)  # no factor


def test_admission_never_rejects_for_size_alone():
    """A 20 s prefill on an idle worker cannot meet a 2 s SLO but is admitted; queued behind 30 s of
    work it is rejected with a Retry-After of that queue."""
    route(20_000, PrefixMatch(), _cluster(), ADMIT_CFG, COST)
    with pytest.raises(Overloaded) as e:
        route(20_000, PrefixMatch(), _cluster(pp=(30.0,), p=(30.0, 30.0)), ADMIT_CFG, COST)
    assert e.value.retry_after_s == pytest.approx(30.0)


# -- static mode untouched -----------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(slo=st.floats(0.1, 10), margin=st.floats(0, 1), factor=st.floats(0.5, 5), append=st.integers(0, 500),
       raw=st.floats(0, 5), heavy=st.floats(0.01, 5), q=st.lists(st.floats(0, 10), min_size=3, max_size=3),
       n=st.integers(1, 5000), l3=st.integers(0, 300), pend=st.integers(0, 300))
def test_static_mode_ignores_the_adaptive_settings(slo, margin, factor, append, raw, heavy, q, n, l3, pend):
    static = RoutingConfig(topology=Topology.CPD, block_size=BS)
    tuned = dataclasses.replace(static, ttft_slo_s=slo, spill_margin=margin, admission_factor=factor,
                                decode_append_max_tokens=append, raw_wait_max_s=raw, heavy_uncached_s=heavy)
    match = PrefixMatch(l1={"d0": l3, "p0": l3 // 2}, l3=l3, l3_pending=pend, l3_pending_ready_s=0.01)
    ws = _cluster(pp=(q[0],), p=(q[1], q[2]))
    assert route(n, match, ws, tuned, COST) == route(n, match, ws, static, COST)
    assert route(n, match, ws, static, COST).reason in (DecisionReason.STATIC, DecisionReason.FALLBACK)


def test_heavy_threshold_default_is_a_share_of_the_slo():
    assert heavy_uncached_s(CFG) == pytest.approx(HEAVY_SLO_SHARE * CFG.ttft_slo_s)
    assert heavy_uncached_s(dataclasses.replace(CFG, heavy_uncached_s=0.1)) == 0.1


def test_medium_work_well_within_the_slo_stays_off_the_short_pool():
    """Rule A2: work above the heavy threshold but well within the SLO (here 1.5x the threshold, under
    half the SLO) is heavy: it waits behind the pre-prefill queue while that still meets the SLO
    rather than lengthen the prefill pool's queue of short work (each request queued after it there
    would wait its whole own work). Work under the threshold is short and takes the prefill pool."""
    rate = COST.prefill_tokens_per_s
    thr = heavy_uncached_s(CFG)
    medium, small = int(1.5 * thr * rate), int(0.8 * thr * rate)  # no cache: own_s = tokens / rate
    assert thr < medium / rate < 0.5 * CFG.ttft_slo_s
    ws = _cluster(pp=(0.6,), p=(0.2, 0.2))  # a heavy prefill queued on pre-prefill, short work on prefill
    d = route(medium, PrefixMatch(), ws, CFG, COST)
    assert (d.request_class, d.pool, d.reason) == (RequestClass.COLD, Role.PRE_PREFILL, DecisionReason.HOME)
    assert d.estimated_ttft_s <= SLO_PREDICTION_SHARE * CFG.ttft_slo_s  # meets the SLO (rule A3)
    d = route(small, PrefixMatch(), ws, CFG, COST)
    assert (d.request_class, d.pool, d.reason) == (RequestClass.WARM, Role.PREFILL, DecisionReason.HOME)


def test_queued_work_counts_the_plan_s_loads_like_compute():
    """work_s (what the dispatch adds to queued_prefill_s) = the plan's L2/L3 loads + the uncached
    compute, and equals the winner's own_s: loads run inside the engine's steps and occupy it."""
    n_l3 = SHORT_TOKENS // BS - 4
    d = route(SHORT_TOKENS, PrefixMatch(l3=n_l3), _cluster(pp=(5.0,), p=(0.0, 5.0)), CFG, COST)
    assert d.load_plan.l3_blocks == n_l3 and d.prefill_worker == "p0"
    load_s = COST.load_time_s("L3", n_l3 * BS * COST.kv_bytes_per_token)
    compute_s = COST.prefill_time_s(SHORT_TOKENS - n_l3 * BS, n_l3 * BS)
    w = work_s(d.load_plan, SHORT_TOKENS, CFG, COST)
    assert load_s > 0 and w == pytest.approx(load_s + compute_s)
    assert w == pytest.approx(_by_id(d)["p0"].own_s)


def test_decode_append_counts_the_appends_already_queued_on_the_decode_worker():
    """The running batch may wait for every queued append at once (one step): an append that is
    small alone is refused where the queued appends and it together exceed the TPOT share, and
    kept on a decode worker with a short enough queue."""
    n = 100 * BS + 30  # 30 ms of compute; share of the 100 ms TPOT SLO: 50 ms
    match = PrefixMatch(l1={"d0": 100, "d1": 100}, l3=100)
    busy = WorkerLoad("d0", Role.DECODE, queued_prefill_s=0.025)  # 25 + 30 ms > 50 ms
    light = WorkerLoad("d1", Role.DECODE, queued_prefill_s=0.015)  # 15 + 30 ms <= 50 ms
    assert 0.025 + 0.03 > DECODE_APPEND_TPOT_SHARE * APPEND_CFG.tpot_slo_s >= 0.015 + 0.03
    d = route(n, match, [_w("p0", Role.PREFILL, 0.5), busy, light], APPEND_CFG, COST)
    assert (d.reason, d.prefill_worker, d.decode_worker) == (DecisionReason.DECODE_APPEND, "d1", "d1")
    assert "d0" not in _by_id(d)
    alone = route(n, match, [_w("p0", Role.PREFILL, 0.5), busy], APPEND_CFG, COST)
    assert alone.pool == Role.PREFILL and all(c.role != Role.DECODE for c in alone.candidates)
