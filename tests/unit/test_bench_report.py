"""`cpd bench` report helpers: percentiles, SLO checks, chunk parsing, compare."""
from __future__ import annotations

import pytest

from cpd.bench import report
from cpd.bench.client import RequestRecord, _chunk_tokens, _error_message, base_url, pick_model


def rec(i, cls="cold", ttft=0.1, tpot=0.01, err=None, out=10, prompt=100, cached=0):
    return RequestRecord(id=f"r{i}", line=i, trace_class=cls, reuse=0.9 if cls == "warm" else 0.1,
                         arrival_s=float(i), prompt_len=prompt, max_tokens=out, send_s=float(i),
                         sched_lag_s=0.0, ttft_s=None if err else ttft, tpot_s=None if err else tpot,
                         e2e_s=1.0, itls_s=[] if err else [tpot] * (out - 1), output_tokens=0 if err else out,
                         prompt_tokens=None if err else prompt, cached_tokens=None if err else cached,
                         status=400 if err else 200, error=err)


def test_stats_and_slo():
    st = report.stats([1.0, 2.0, 3.0, 4.0, None])
    assert st["n"] == 4 and st["mean"] == 2.5 and st["p50"] == 2.5 and st["p99"] == pytest.approx(3.97)
    assert report.stats([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert report.meets_slo(rec(0, ttft=0.5, tpot=0.02), 0.5, 0.02)
    assert not report.meets_slo(rec(0, ttft=0.6), 0.5, None)
    assert not report.meets_slo(rec(0, tpot=0.03), None, 0.02)
    assert not report.meets_slo(rec(0, err="HTTP 500: x"), None, None)
    one_token = rec(0, out=1)
    one_token.tpot_s = None
    assert report.meets_slo(one_token, 1.0, 0.001)


def test_summarize_groups_and_ratios():
    rs = [rec(0, "warm", ttft=0.1, cached=80), rec(1, "warm", ttft=0.2, cached=60), rec(2, ttft=1.0),
          rec(3, err="HTTP 503: busy"), rec(4, err="timeout after 5s")]
    s = report.summarize(rs, slo_ttft_s=0.5)
    assert s["duration_s"] == pytest.approx(4 + 1.0)  # first send 0 -> last finish 5
    assert s["errors"] == 2 and s["error_kinds"] == {"HTTP 503": 1, "timeout": 1}
    assert s["warm"]["ttft"]["p50"] == pytest.approx(0.15) and s["cold"]["ttft"]["n"] == 1
    assert s["slo_met"] == 2 and s["goodput"] == pytest.approx(2 / 5)
    assert s["cache_hit_ratio"] == pytest.approx(140 / 300)
    assert s["output_throughput"] == pytest.approx(30 / 5)
    assert s["all"]["itl"]["n"] == 27


def test_chunk_parsing_helpers():
    assert _chunk_tokens({"choices": [{"text": "ab"}]}) == 1
    assert _chunk_tokens({"choices": [{"text": ""}]}) == 0
    assert _chunk_tokens({"choices": [{"text": "abc", "token_ids": [5, 6, 7]}]}) == 3
    assert _chunk_tokens({"choices": [{"delta": {"content": "x"}}]}) == 1
    assert _chunk_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == 0
    assert _error_message(429, b'{"error": {"message": "slow down"}}') == "HTTP 429: slow down"
    assert _error_message(422, b'{"detail": "bad"}') == "HTTP 422: bad"
    assert _error_message(500, b"oops") == "HTTP 500: oops"
    assert base_url("http://h:1/v1/") == "http://h:1" and base_url("http://h:1") == "http://h:1"
    assert pick_model([{"id": "a"}, {"id": "b"}])["id"] == "a"
    assert pick_model([{"id": "a"}, {"id": "b"}], "b")["id"] == "b"
    with pytest.raises(ValueError):
        pick_model([{"id": "a"}], "z")


def test_compare_prints_and_plots(tmp_path):
    paths = []
    for label, t in (("pd", 0.4), ("cpd", 0.2)):
        rs = [rec(i, "warm" if i % 2 else "cold", ttft=t * (i + 1)) for i in range(6)]
        p = tmp_path / f"{label}.json"
        report.write_results(p, {"label": label}, report.summarize(rs), rs)
        paths.append(p)
    from rich.console import Console
    con = Console(record=True, width=140)
    docs = report.compare(paths, plot=tmp_path / "c.png", console=con)
    text = con.export_text()
    assert [d["label"] for d in docs] == ["pd", "cpd"] and "pd" in text and "cpd" in text
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        (tmp_path / "bad.json").write_text("[]")
        report.load_results(tmp_path / "bad.json")
