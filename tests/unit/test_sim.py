"""The simulator's experiment layer on the engine core: configurations by name, warm-up and
confidence-interval statistics, goodput under TTFT and TPOT SLOs, the saturation search,
determinism of sweeps, the CLI; workloads. (The engine core itself: M/D/1, infinite-cache hit
ratio, closed loop, determinism of runs: tests/integration/test_sim_engine.py.)"""
import json
import math
import random

import pytest

from cpd.sim import sweep as sweepmod
from cpd.sim.experiment import build_cluster, config_spec, load_experiment, num_gpus, run_point
from cpd.sim.stats import mean_ci, mser5
from cpd.sim.sweep import compare, run_sweep, search_saturation
from cpd.sim.workload import AgentWorkload, agent_workload, load_mooncake, write_mooncake
from cpd.types import RoutingMode, WriteThrough


def tiny_exp():
    """The reference experiment with small contexts and short points (seconds of wall time)."""
    exp = load_experiment("reference_b200")
    exp.update(ramp_s=2, steady_s=20, drain_s=10, qps_per_gpu=[0.5, 1.0], seeds=2)
    exp["workload"].update(first_context=6000, turn_suffix=300, output_tokens=12, system_prompt=512,
                           compacted_context=2000, max_context=16000, min_turn_gap_s=2, mean_turn_gap_s=4)
    return exp


def test_mser5_drops_the_transient_and_keeps_a_stationary_series():
    rng = random.Random(2)
    transient = [5.0 - 4.0 * k / 60 for k in range(60)]
    steady = [1.0 + rng.gauss(0, 0.1) for _ in range(600)]
    cut = mser5(transient + steady)
    assert 45 <= cut <= 75
    assert mser5(steady) <= 50
    assert mser5([1.0] * 7) == 0


def test_mean_ci_is_the_student_t_interval():
    ci = mean_ci([1.0, 2.0, 3.0])
    assert ci["mean"] == 2.0 and ci["n"] == 3
    assert ci["hi"] - ci["mean"] == pytest.approx(4.303 / math.sqrt(3), rel=1e-4)
    assert mean_ci([0.7]) == {"mean": 0.7, "lo": 0.7, "hi": 0.7, "n": 1}
    assert mean_ci([])["mean"] is None


def test_named_configurations_use_the_same_gpus_and_the_live_settings():
    exp = load_experiment("reference_b200")
    clusters = {c: build_cluster(exp, c) for c in ("pd", "pd-l3", "cpd-static", "cpd")}
    assert len({num_gpus(c) for c in clusters.values()}) == 1
    assert clusters["pd"].l3_bytes == 0 and clusters["pd-l3"].l3_bytes > 0
    assert clusters["pd-l3"].routing.resolved_write_through() == WriteThrough.ALL
    assert clusters["cpd"].routing.mode == RoutingMode.ADAPTIVE
    assert clusters["cpd-static"].routing.mode == RoutingMode.STATIC
    assert {i.role for i in clusters["cpd"].instances} == {"pre-prefill", "prefill", "decode"}
    with pytest.raises(KeyError, match="unknown configuration"):
        config_spec(exp, "nope")


def test_point_reports_goodput_warmup_and_busy_time_per_pool():
    exp = tiny_exp()
    p = run_point(exp, "cpd-static", 0.5, seed=1)
    assert p["requests"] > 20 and p["completion_ratio"] == 1.0
    assert p["warmup_s"] >= exp["ramp_s"]
    assert set(p["busy_fraction"]) == {"pre-prefill", "prefill", "decode"}
    assert all(0 < v <= 1 for v in p["busy_fraction"].values())
    assert p["goodput"] > 0.8
    strict = json.loads(json.dumps(exp))
    strict["slo"]["tpot_s"] = 1e-6  # no decode is that fast: TPOT fails every request
    assert run_point(strict, "cpd-static", 0.5, seed=1)["goodput"] == 0.0


def test_saturation_search_finds_the_goodput_crossing(monkeypatch):
    """A synthetic goodput curve g(q) = 1 - q / 4.2 crosses 0.9 at 0.42 QPS/GPU."""
    calls = []

    def fake(exp, config, q, seed, overrides=None):
        calls.append(q)
        return {"qps_per_gpu": q, "goodput": 1 - q / 4.2, "busy_fraction": {"prefill": q}}
    monkeypatch.setattr(sweepmod, "run_point", fake)
    exp = {"qps_per_gpu": [0.2, 0.6, 1.0], "search": {"iters": 3}, "slo": {"goodput_min": 0.9}}
    r = search_saturation(exp, "pd", 1)
    assert r["bounded"] == "interpolated" and r["qps_per_gpu"] == pytest.approx(0.42, abs=1e-4)
    assert r["last_ok"] == 0.4 and r["first_fail"] == 0.45
    assert calls[:2] == [0.2, 0.6] and len(calls) == 5  # grid until the first failure, then 3 bisections
    low = search_saturation({**exp, "qps_per_gpu": [0.8]}, "pd", 1)
    assert low["bounded"] == "interpolated" and low["qps_per_gpu"] == pytest.approx(0.42, abs=1e-4)
    none = search_saturation({**exp, "slo": {"goodput_min": 0.0}, "search": {"max_qps_per_gpu": 1.4}}, "pd", 1)
    assert none["bounded"] == "at-least" and none["qps_per_gpu"] == 1.4


def test_sweeps_are_byte_identical_and_do_not_depend_on_jobs():
    exp = tiny_exp()
    exp["qps_per_gpu"] = [0.5]
    a = json.dumps(run_sweep(exp, ["pd", "cpd-static"]), sort_keys=True)
    b = json.dumps(run_sweep(exp, ["pd", "cpd-static"], jobs=2), sort_keys=True)
    assert a == b
    res = json.loads(a)
    assert len(res["points"]) == 4 and res["seeds"] == [1, 2]
    assert all(r["n_seeds"] == 2 for r in res["rows"])


def test_simulate_cli_sweep_and_compare(tmp_path):
    import typer
    from typer.testing import CliRunner

    from cpd.sim.cli import simulate
    exp = tiny_exp()
    exp["qps_per_gpu"] = [0.5]
    exp["search"] = {"iters": 1, "max_qps_per_gpu": 1.0}
    p = tmp_path / "exp.json"
    p.write_text(json.dumps(exp))
    app = typer.Typer()
    app.command()(simulate)
    r = CliRunner().invoke(app, [str(p), "--out", str(tmp_path / "o"), "--no-progress", "--jobs", "1",
                                 "--config", "pd", "--seeds", "2"])
    assert r.exit_code == 0, r.output
    for f in ("results.json", "report.md", "goodput_vs_qps.png", "busy_vs_qps.png"):
        assert (tmp_path / "o" / f).stat().st_size > 0
    assert "95 % CI" in (tmp_path / "o" / "report.md").read_text()
    js = tmp_path / "cmp.json"
    r = CliRunner().invoke(app, [str(p), "--compare", "pd,cpd", "--seeds", "2", "--json", str(js), "--jobs", "2",
                                 "--no-progress"])
    assert r.exit_code == 0, r.output
    assert "| pd |" in r.output and "| cpd |" in r.output
    res = json.loads(js.read_text())
    for c in ("pd", "cpd"):
        d = res["configs"][c]
        assert d["n_seeds"] == 2 and len(d["ci"]) == 2 and d["saturation_qps_per_gpu"] is not None
        assert d["ci"][0] <= d["saturation_qps_per_gpu"] <= d["ci"][1]
    r = CliRunner().invoke(app, [str(p), "--compare", "pd,bogus"])
    assert r.exit_code == 2 and "unknown configuration" in r.output


def test_agent_generator_writes_valid_mooncake(tmp_path):
    w = AgentWorkload(cold_fraction=0.1)
    reqs, pre = agent_workload(w, 5.0, 120.0, 10.0, seed=3)
    reqs2, _ = agent_workload(w, 5.0, 120.0, 10.0, seed=3)
    assert reqs == reqs2 and len(pre) == 150
    p = tmp_path / "agent.jsonl"
    write_mooncake(reqs, p)
    back = load_mooncake(p)
    assert len(back) == len(reqs)
    for r in back:
        assert len(r.blocks) == math.ceil(r.prompt_tokens / 512)
    warm = [r for r in reqs if r.tag == "warm"]
    assert warm and all(r.prompt_tokens > 40_000 for r in warm)


def test_trace_replay_scaling(trace_path=None):
    from tests.conftest import TRACE
    r1 = load_mooncake(TRACE, limit=200)
    r2 = load_mooncake(TRACE, limit=200, time_scale=2.0, tokens_per_hash_id=64)
    assert r2[-1].arrival_s == pytest.approx(r1[-1].arrival_s / 2)
    assert r2[5].prompt_tokens == round(r1[5].prompt_tokens / 8)
    assert r2[5].blocks == r1[5].blocks


def test_gen_cli_writes_mooncake(tmp_path):
    import typer
    from typer.testing import CliRunner

    from cpd.sim.gen import generate
    app = typer.Typer()
    app.command()(generate)
    out = tmp_path / "a.jsonl"
    r = CliRunner().invoke(app, [str(out), "--qps", "2", "--duration-s", "60", "--seed", "4"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert rows and set(rows[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
