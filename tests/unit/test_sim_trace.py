"""Infinite-cache token hit ratio of the Mooncake conversation trace (512-token blocks) = 37.4 %."""
import pytest

from cpd.analyze.stats import lru_hit_ratio, reuse_profile
from cpd.sim.workload import load_mooncake
from tests.conftest import TRACE


def test_conversation_trace_infinite_cache_hit_ratio():
    reqs = load_mooncake(TRACE)
    prof = reuse_profile(reqs)
    assert round(prof.token_hit_ratio * 100, 1) == 37.4
    assert lru_hit_ratio(reqs, None) == pytest.approx(reuse_profile(reqs, count_partial=False).token_hit_ratio)


def test_simulate_cli_takes_a_claude_code_trace(tmp_path):
    """`cpd simulate --trace DIR` with the reference defaults, no experiment JSON written by hand."""
    import json

    import typer
    from typer.testing import CliRunner

    from cpd.sim.cli import simulate
    from tests.unit.test_traces import conversation, write_cc
    d = write_cc(tmp_path / "cc", [conversation(f"trace_00{i:02d}") for i in range(1, 30)])
    app = typer.Typer()
    app.command()(simulate)
    args = ["--trace", str(d), "--out", str(tmp_path / "o"), "--steady-s", "60", "--config", "pd",
            "--config", "cpd-static", "--qps", "0.2", "--seeds", "1", "--no-progress", "--jobs", "2"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "B200" in r.output and "Llama-3.1-8B" in r.output and "SLO" in r.output
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert {p["config"] for p in res["points"]} == {"pd", "cpd-static"}
    assert all(p["requests"] > 0 and p["completion_ratio"] == 1.0 and p["ttft_s"]["p90"] > 0 for p in res["points"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    r = CliRunner().invoke(app, ["--trace", str(bad), "--out", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "bad.jsonl:1: expected" in r.output


def test_trace_prompts_fit_the_modeled_context():
    """Claude Code sessions reach ~424K-token prompts; a simulated point truncates them to the modeled
    model's context minus their output, as the live replay does, instead of the engines refusing them
    mid-run (which ended the whole point with a ValueError)."""
    from cpd.sim.experiment import _costs, load_experiment, make_workload
    from tests.conftest import SHARED
    exp = load_experiment("reference_b200")
    exp.update({"ramp_s": 5, "steady_s": 200, "workload": {"kind": "trace", "path": str(SHARED / "data" / "traces" / "claude_code"), "max_idle_s": 60.0}})
    reqs, _ = make_workload(exp, 2.0, seed=1)
    ctx = _costs(exp)[0].model.max_context
    assert reqs and max(r.prompt_tokens + r.output_tokens for r in reqs) <= ctx
    assert max(r.prompt_tokens for r in reqs) > ctx // 2  # long sessions are kept, cut at the context


def test_seeds_replay_different_slices_of_a_timed_trace():
    """A timed trace has one arrival sequence: each seed starts at its own request (deterministic per
    seed), so seeds give a real spread; an explicit ``start`` is kept."""
    from cpd.sim.experiment import load_experiment, make_workload, slice_start
    exp = load_experiment("reference_b200")
    exp.update({"ramp_s": 5, "steady_s": 20, "workload": {"kind": "trace", "path": str(TRACE)}})
    first = {seed: make_workload(exp, 4.0, seed)[0][0].blocks for seed in (1, 2, 3)}
    assert len(set(first.values())) == 3
    assert make_workload(exp, 4.0, 2)[0][0].blocks == first[2]
    exp["workload"]["start"] = 0
    assert make_workload(exp, 4.0, 1)[0][0].blocks == make_workload(exp, 4.0, 2)[0][0].blocks
    assert slice_start(100, 100, 7) == 0 and slice_start(100, 500, 7) == 0
    assert all(0 <= slice_start(1000, 100, s) <= 900 for s in range(50))
