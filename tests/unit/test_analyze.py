"""`cpd analyze` on a slice of the Mooncake conversation trace (no quick simulation: fast)."""
import pytest
import typer
from typer.testing import CliRunner

from cpd.analyze.cli import analyze
from cpd.policy.routing import HEAVY_SLO_SHARE
from tests.conftest import TRACE


def test_analyze_report_and_plots(tmp_path):
    sl = tmp_path / "slice.jsonl"
    with open(TRACE) as f:
        sl.write_text("".join(next(f) for _ in range(2000)))
    app = typer.Typer()
    app.command()(analyze)
    r = CliRunner().invoke(app, [str(sl), "--out", str(tmp_path / "o"), "--no-simulate"])
    assert r.exit_code == 0, r.output
    rep = (tmp_path / "o" / "report.md").read_text()
    for s in ("token hit ratio", "Recompute vs load", "Verdict", "Recommendation", "pre-prefill", "reuse distance",
              "no configuration chosen"):
        assert s in rep
    assert (tmp_path / "o" / "reuse.png").stat().st_size > 1000
    assert (tmp_path / "o" / "lru_curve.png").exists()


def _run(args):
    app = typer.Typer()
    app.command()(analyze)
    return CliRunner().invoke(app, args)


def test_analyze_claude_code_slice_hit_ratio_matches_independent_count(tmp_path):
    import json as _json
    import re

    from tests.unit.test_traces import conversation, independent_hit_ratio, write_cc
    convs = [conversation("trace_0001"), conversation("trace_0002")]
    d = write_cc(tmp_path / "cc", convs)
    r = _run([str(d), "--out", str(tmp_path / "o"), "--no-simulate"])
    assert r.exit_code == 0, r.output
    rep = (tmp_path / "o" / "report.md").read_text()
    hit = float(re.search(r"token hit ratio: \*\*([0-9.]+) %", rep).group(1))
    assert hit == round(independent_hit_ratio(convs) * 100, 1)
    for s in ("claude_code", "uncached tokens p50/p90/p99", "share of prefill work", "| subagent |",
              "no supported verdict"):
        assert s in rep
    assert (tmp_path / "o" / "uncached_cdf.png").stat().st_size > 1000


def test_analyze_azure_csv_states_no_prefix_info_and_bad_csv_is_clean(tmp_path):
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:17:{i:02d}.5000000,{300 + 10 * i},7\n" for i in range(30)))
    r = _run([str(p), "--out", str(tmp_path / "o"), "--no-simulate"])
    assert r.exit_code == 0, r.output
    assert "no prefix information" in (tmp_path / "o" / "report.md").read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.5,x,1\n")
    r = _run([str(bad), "--out", str(tmp_path / "o2"), "--no-simulate"])
    assert r.exit_code == 2 and "bad.csv:2: expected" in r.output and "Traceback" not in r.output


def test_analyze_session_profile_counts_subagents_and_duration(tmp_path):
    """The session section counts each conversation's requests with its subagent's (4 + 2) and
    measures its duration on the session's own clock (first request to the end of the last)."""
    import re

    from cpd.analyze.sessions import session_stats
    from cpd.traces import read_trace
    from tests.unit.test_traces import conversation, write_cc
    d = write_cc(tmp_path / "cc", [conversation("trace_0001"), conversation("trace_0002")])
    st = [session_stats(s) for s in read_trace(d).sessions]
    assert [x.num_requests for x in st] == [6, 6]
    assert [x.num_subagents for x in st] == [1, 1]
    assert all(x.first_input_tokens == 260 and x.max_input_tokens == 710 for x in st)
    assert all(x.duration_s == 42.0 for x in st)  # last request at t=41 s plus its api_time of 1 s
    r = _run([str(d), "--out", str(tmp_path / "o"), "--no-simulate"])
    assert r.exit_code == 0, r.output
    rep = (tmp_path / "o" / "report.md").read_text()
    assert re.search(r"2 sessions; requests per session p50/p90/max: 6 / 6 / 6", rep), rep
    assert (tmp_path / "o" / "sessions.png").stat().st_size > 1000


@pytest.mark.parametrize("args,flag", [(["--ttft-slo-s", "0"], "--ttft-slo-s"), (["--tpot-slo-s", "-0.05"], "--tpot-slo-s"),
                                       (["--ttft-slo-s", "nan"], "--ttft-slo-s"), (["--tpot-slo-s", "abc"], "--tpot-slo-s"),
                                       (["--sim-configs", "pd,turbo"], "--sim-configs"),
                                       (["--sim-loads", "0.5,x"], "--sim-loads"), (["--total-gpus", "4"], "--total-gpus")])
def test_analyze_bad_options_are_usage_errors(tmp_path, args, flag):
    """A bad SLO, configuration list, load list or GPU count: exit code 2, the flag named, no traceback."""
    sl = tmp_path / "slice.jsonl"
    with open(TRACE) as f:
        sl.write_text("".join(next(f) for _ in range(50)))
    r = _run([str(sl), "--out", str(tmp_path / "o"), "--no-simulate", *args])
    assert r.exit_code == 2, r.output
    assert flag in r.output and "Traceback" not in r.output


def test_analyze_recommendation_on_a_trace_slice(tmp_path):
    """A tiny slice of the Mooncake trace, short windows, one seed, two loads: the chosen
    configuration is the one with the highest simulated saturation in recommendation.json, and
    the report and stdout carry its figures and its `cpd serve` flags."""
    import json as _json
    sl = tmp_path / "slice.jsonl"
    with open(TRACE) as f:
        sl.write_text("".join(next(f) for _ in range(300)))
    r = _run([str(sl), "--out", str(tmp_path / "o"), "--total-gpus", "12", "--sim-configs", "pd,cpd",
              "--sim-steady-s", "4", "--sim-loads", "1.5,3", "--sim-iters", "0", "--ttft-slo-s", "1.5"])
    assert r.exit_code == 0, r.output
    rec = _json.loads((tmp_path / "o" / "recommendation.json").read_text())
    sat = {c: d["saturation_qps_per_gpu"] for c, d in rec["configs"].items()}
    assert set(sat) == {"pd", "cpd"} and all(x is not None for x in sat.values())
    assert sat[rec["choice"]["config"]] == max(sat.values())
    assert rec["choice"]["separated"] is False and "not separated" in rec["choice"]["why"]  # one seed: no interval
    assert rec["slo"]["ttft_s"] == 1.5 and rec["classes"]["heavy_uncached_s"] == pytest.approx(HEAVY_SLO_SHARE * 1.5)
    assert rec["budget"]["points"] >= len(sat) and rec["budget"]["requests"] > 0
    pools = rec["pools"]
    assert pools["pre-prefill"] + pools["prefill"] == rec["nodes"]["prefill_side_workers"] == 2
    flags = " ".join(rec["serve_flags"])
    assert f"--decode {pools['decode']}" in flags
    rep = (tmp_path / "o" / "report.md").read_text()
    for text in (rep, r.output):
        assert "## Recommendation" in text and f"cpd serve {flags}" in text
        assert f"Cost: {rec['budget']['points']} points" in text
        for c, x in sat.items():
            assert f"| {c} | " in text and (f"{x:.3f}" in text)
