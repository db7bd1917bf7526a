"""The pure rules of ``cpd analyze``'s recommendation (cpd/analyze/recommend.py): the adaptive
policy's classes, the role planner's split, the decode sizing, the choice between simulated
configurations, the ``cpd serve`` flags and the CPD verdict."""
import argparse
import itertools

import pytest

from cpd.analyze.recommend import (Settled, choose, class_work, cpd_verdict, decode_nodes, planner_settles,
                                   serve_flags, split_prefill_side)
from cpd.policy.roles import PlannerConfig
from cpd.policy.routing import HEAVY_SLO_SHARE, LinearCostModel, RoutingConfig
from cpd.types import RoutingMode

PCFG = PlannerConfig()


def _max_load(cold, warm, pre, n):
    return max(cold / pre if pre else (float("inf") if cold else 0.0),
               warm / (n - pre) if n - pre else (float("inf") if warm else 0.0))


def test_split_all_cold_all_warm_mixed():
    n = 10
    # all cold: every worker but the prefill minimum; all warm: only the pre-prefill minimum
    assert split_prefill_side(4.0, 0.0, n).pre_prefill == n - PCFG.min_prefill
    assert split_prefill_side(0.0, 4.0, n).pre_prefill == PCFG.min_pre_prefill
    # no work at all: the minimum (fewer pre-prefill on ties)
    assert split_prefill_side(0.0, 0.0, n).pre_prefill == PCFG.min_pre_prefill
    # mixed 3:1 on 8 workers: 6 / 2 gives both pools 0.5 s/s per worker
    s = split_prefill_side(3.0, 1.0, 8)
    assert (s.pre_prefill, s.prefill) == (6, 2) and s.load_pre_prefill == s.load_prefill == 0.5
    with pytest.raises(ValueError):
        split_prefill_side(1.0, 1.0, 1)


@pytest.mark.parametrize("cold,warm,n", list(itertools.product((0.0, 0.3, 1.0, 2.5, 7.0), (0.0, 0.4, 1.0, 6.0),
                                                               (2, 3, 5, 9))))
def test_split_is_the_planner_target_and_its_fixed_point(cold, warm, n):
    """No other split within the minimums has a smaller larger per-worker load, and the live
    planner (plan_roles), started at the split with these rates, moves nobody."""
    s = split_prefill_side(cold, warm, n)
    best = min(_max_load(cold, warm, k, n) for k in range(PCFG.min_pre_prefill, n - PCFG.min_prefill + 1))
    assert _max_load(cold, warm, s.pre_prefill, n) == best
    assert planner_settles(cold, warm, n, s.pre_prefill) == Settled(s.pre_prefill, n - s.pre_prefill, ())


def test_planner_from_one_pre_prefill_moves_towards_the_split_with_reasons():
    """Started at the minimum, the planner only moves workers towards the cold pool, each move
    with a reason; its hysteresis may stop it before the split (it never overshoots)."""
    n = 10
    s = split_prefill_side(9.0, 1.0, n)
    st = planner_settles(9.0, 1.0, n, 1)
    assert 1 < st.pre_prefill <= s.pre_prefill and len(st.reasons) == st.pre_prefill - 1
    assert all(r.startswith("balance") for r in st.reasons)
    # the next move is one the planner refuses: it lowers the larger load by no more than the hysteresis
    if st.pre_prefill < s.pre_prefill:
        k = st.pre_prefill
        assert _max_load(9.0, 1.0, k + 1, n) >= (1 - PCFG.hysteresis) * _max_load(9.0, 1.0, k, n)


def test_class_work_matches_the_policy_threshold():
    """Heavy = uncached compute on the prefix holder above HEAVY_SLO_SHARE of the TTFT SLO (LinearCostModel:
    1000 tokens/s, so a request's own work is its uncached tokens / 1000; the SLO is chosen so the
    threshold is 0.5 s)."""
    cost = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1000.0)
    cfg = RoutingConfig(mode=RoutingMode.ADAPTIVE, ttft_slo_s=0.5 / HEAVY_SLO_SHARE, block_size=16)
    prompts = [2000, 3200, 160, 4000, 640]
    cached = [0, 3200, 0, 3520, 320]   # 3200 fully cached: at least one token is computed (last block)
    cw = class_work(prompts, cached, cfg, cost)
    own = [(p - min(c // 16 * 16, (p - 1) // 16 * 16)) / 1000 for p, c in zip(prompts, cached)]
    assert cw.heavy_uncached_s == 0.5
    assert cw.num_heavy == sum(o > 0.5 for o in own) == 1
    assert cw.cold_work_s == pytest.approx(sum(o for o in own if o > 0.5))
    assert cw.warm_work_s == pytest.approx(sum(o for o in own if o <= 0.5))
    c, w = cw.rates(10.0)
    assert c == pytest.approx(cw.cold_work_s / 5 * 10) and w == pytest.approx(cw.warm_work_s / 5 * 10)
    # a tighter SLO halves the threshold and turns the 0.48 s and 0.32 s requests heavy too
    tight = class_work(prompts, cached, RoutingConfig(mode=RoutingMode.ADAPTIVE, ttft_slo_s=0.25 / HEAVY_SLO_SHARE,
                                                      block_size=16), cost)
    assert tight.num_heavy == sum(o > 0.25 for o in own) == 3


def test_class_work_on_a_real_claude_code_trace():
    """On a real Claude Code session (read through cpd.traces), the share of heavy work grows as
    the SLO tightens, and the classes split the same total work."""
    from cpd.analyze.stats import reuse_profile
    from cpd.sim.workload import schedule_to_sim
    from cpd.traces import ReplayOptions, Vocab, build_schedule, read_trace
    from tests.conftest import SHARED
    path = SHARED / "data" / "traces" / "claude_code" / "trace_0004.json.gz"
    if not path.exists():
        pytest.skip("shared traces not available")
    tr = read_trace(path)
    reqs = schedule_to_sim(build_schedule(tr, ReplayOptions(session_rate=0.05), Vocab(2)), tr.block_tokens,
                           tr.block_tokens)
    prof = reuse_profile(reqs, block_tokens=tr.block_tokens)
    cost = LinearCostModel(kv_bytes_per_token=131072, prefill_tokens_per_s=20000.0)
    shares = []
    for slo in (4.0, 1.0, 0.25):
        cfg = RoutingConfig(mode=RoutingMode.ADAPTIVE, ttft_slo_s=slo, block_size=tr.block_tokens)
        cw = class_work([r.prompt_tokens for r in reqs], prof.cached_tokens, cfg, cost)
        shares.append((cw.cold_share, cw.cold_work_s + cw.warm_work_s))
    assert shares[0][0] <= shares[1][0] <= shares[2][0] and shares[2][0] > 0
    assert shares[0][1] == pytest.approx(shares[2][1])


def test_decode_nodes_by_busy_time():
    # decode takes a quarter of the GPU-seconds: a quarter of 32 GPUs = 2 nodes of 4
    assert decode_nodes(3.0, 1.0, 32, 4, 4) == 2
    assert decode_nodes(1.0, 0.0, 32, 4, 4) == 1                 # at least one
    assert decode_nodes(0.0, 1.0, 16, 4, 4) == 2                 # leaves two prefill-side workers
    with pytest.raises(ValueError):
        decode_nodes(1.0, 1.0, 8, 4, 4)


def _cfg(x, lo=None, hi=None, n=1, at_least=False):
    return {"saturation_qps_per_gpu": x, "ci": [x if lo is None else lo, x if hi is None else hi], "n_seeds": n,
            "at_least": at_least, "below_lowest": False}


def test_choose_separated_only_with_disjoint_intervals():
    sep = choose({"pd": _cfg(0.8, 0.75, 0.85, 3), "cpd": _cfg(1.1, 1.0, 1.2, 3)})
    assert sep.config == "cpd" and sep.runner_up == "pd" and sep.separated and "disjoint" in sep.why
    ov = choose({"pd-l3": _cfg(0.82, 0.80, 0.84, 3), "cpd": _cfg(0.83, 0.81, 0.85, 3), "pd": _cfg(0.5, 0.4, 0.6, 3)})
    assert ov.config == "cpd" and not ov.separated and "not separated from pd-l3" in ov.why
    assert ov.within_interval == ("pd-l3", "cpd")
    one = choose({"pd": _cfg(0.8), "cpd-static": _cfg(1.2)})
    assert one.config == "cpd-static" and not one.separated and "one seed" in one.why
    capped = choose({"pd": _cfg(0.8, 0.7, 0.9, 3), "cpd": _cfg(2.4, n=3, at_least=True)})
    assert capped.config == "cpd" and not capped.separated and "bound" in capped.why
    tie = choose({"cpd": _cfg(1.0), "pd-l3": _cfg(1.0)})
    assert tie.config == "pd-l3"                                  # equal means: the simpler one


def test_choose_identical_seeds_measure_no_spread():
    """Three seeds that all gave the same saturation (a timed trace replays the same arrivals for
    every seed) make a zero-width interval: that is no evidence of separation."""
    same = {"pd": {**_cfg(1.898, n=3), "per_seed": [1.898] * 3}, "cpd": {**_cfg(1.95, n=3), "per_seed": [1.95] * 3}}
    ch = choose(same)
    assert ch.config == "cpd" and not ch.separated and "same saturation" in ch.why
    varied = {"pd": {**_cfg(1.9, 1.85, 1.95, 3), "per_seed": [1.85, 1.9, 1.95]},
              "cpd": {**_cfg(2.2, 2.1, 2.3, 3), "per_seed": [2.1, 2.2, 2.3]}}
    assert choose(varied).separated
    # the verdict counts identical seeds as one seed: a 10 % gain is a gain, not a measured separation
    assert "CPD pays" in cpd_verdict({"pd": {**_cfg(1.0, n=3), "per_seed": [1.0] * 3},
                                      "cpd": {**_cfg(1.1, n=3), "per_seed": [1.1] * 3}})


def _parse(flags):
    from cpd.config import FLAGS, add_argparse_flags, argparse_overrides, build_config
    p = argparse.ArgumentParser()
    add_argparse_flags(p, FLAGS)
    ov = {k: v for k, v in argparse_overrides(p.parse_args(flags), FLAGS).items() if v is not None}
    return build_config(overrides=ov)


@pytest.mark.parametrize("name", ["pd", "pd-l3", "cpd-static", "cpd", "cpd-elastic"])
def test_serve_flags_build_the_configuration(name):
    """The flags parse with cpd's own flag table into a valid configuration of that name."""
    pools = {"pre-prefill": 2, "prefill": 3, "decode": 8}
    cfg = _parse(serve_flags(name, pools, 0.7, 0.04))
    cpd = name.startswith("cpd")
    assert cfg.deployment.topology == ("cpd" if cpd else "pd")
    assert cfg.deployment.pool_sizes() == (pools if cpd else {"pre-prefill": 0, "prefill": 5, "decode": 8})
    assert cfg.router.routing_mode == ("adaptive" if name in ("cpd", "cpd-elastic") else "static")
    assert cfg.router.elastic == (name == "cpd-elastic")
    assert (cfg.router.write_through == "all") == (name == "pd-l3")
    if cfg.router.routing_mode == "adaptive":
        assert (cfg.router.ttft_slo_s, cfg.router.tpot_slo_s) == (0.7, 0.04)
    with pytest.raises(ValueError):
        serve_flags("cpd-turbo", pools, 1.0, 0.05)


def test_cpd_verdict_needs_bounded_and_separated_saturations():
    below = {"pd": {"saturation_qps_per_gpu": 0.0, "below_lowest": True, "n_seeds": 1, "ci": [0, 0]},
             "cpd": _cfg(0.3)}
    assert "no supported verdict" in cpd_verdict(below)
    pays = cpd_verdict({"pd": _cfg(0.8), "cpd-static": _cfg(1.1)})
    assert "CPD pays" in pays and "1.100" in pays and "0.800" in pays
    assert "does not pay" in cpd_verdict({"pd": _cfg(0.8), "cpd": _cfg(0.82)})
    overlap = {"pd": _cfg(0.8, 0.6, 1.0, 3), "cpd": _cfg(0.9, 0.85, 0.95, 3)}
    assert "no supported verdict" in cpd_verdict(overlap) and "overlap" in cpd_verdict(overlap)
    assert "no supported verdict" in cpd_verdict({"cpd": _cfg(1.0)})


def test_window_splits_follow_the_mix():
    """Per window the planner's target: a cold-only window wants every worker but the prefill
    minimum, a warm-only one the pre-prefill minimum; windows without arrivals are left out."""
    from cpd.analyze.recommend import window_splits
    n = 6
    arrivals = [0.0, 5.0, 10.0, 35.0, 40.0, 95.0]
    own = [2.0, 3.0, 1.0, 0.1, 0.2, 0.3]           # threshold 0.5: heavy, heavy, heavy | short, short | short
    assert window_splits(arrivals, own, 0.5, 30.0, n) == [n - PCFG.min_prefill, PCFG.min_pre_prefill,
                                                           PCFG.min_pre_prefill]
    # one window holding everything: the split of the totals
    whole = window_splits(arrivals, own, 0.5, 1000.0, n)
    assert whole == [split_prefill_side(6.0, 0.6, n).pre_prefill]
    assert window_splits([], [], 0.5, 30.0, n) == []
    with pytest.raises(ValueError):
        window_splits(arrivals, own, 0.5, 0.0, n)


def test_first_failing_load_names_the_slo_it_misses():
    from cpd.analyze.deployment import _first_fail
    slo = {"ttft_s": 1.0, "tpot_s": 0.05}

    def pt(q, g, ttft, tpot):
        return {"qps_per_gpu": q, "goodput": g, "ttft_s": {"p90": ttft}, "tpot_s": {"p90": tpot}}
    pts = [pt(2.0, 0.5, 3.0, 0.2), pt(1.0, 0.95, 0.4, 0.01), pt(1.5, 0.7, 0.5, 0.12)]
    f = _first_fail(pts, slo)
    assert f["qps_per_gpu"] == 1.5 and f["limit"] == "tpot"
    assert _first_fail([pt(1.0, 0.5, 2.0, 0.01)], slo)["limit"] == "ttft"
    assert _first_fail([pt(1.0, 0.5, 2.0, 0.2)], slo)["limit"] == "both"
    assert _first_fail([pt(1.0, 0.85, 0.9, 0.04)], slo)["limit"] == "neither"
    assert _first_fail([pt(1.0, 0.95, 0.4, 0.01)], slo) is None
