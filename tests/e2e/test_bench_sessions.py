"""`cpd bench` session replay of a Claude Code slice against a live tiny-model deployment.

Closed loop (one user): subagent siblings run concurrently (their lifetimes overlap although only
one user sends), the parent's next turn waits for them; open loop: Poisson
session starts with in-session ``t`` kept. The report is split by request kind.
"""
from __future__ import annotations

import gzip
import json
import time

import pytest

from cpd.bench.cli import run_bench
from tests.deploy_util import assert_no_leaks, start


def _req(t, n_in, ids, think=0.2, api=0.1):
    return {"t": t, "type": "s", "in": n_in, "out": 3, "hash_ids": ids, "api_time": api, "think_time": think}


def _conversation(cid):
    subs = [{"t": 1.0 + 0.05 * k, "type": "subagent", "agent_id": f"a{k}", "subagent_type": "Explore",
             "tool_tokens": 0, "system_tokens": 0,
             "requests": [_req(0.0, 64 * 6, [100 * (k + 1) + j for j in range(6)]),
                          _req(0.5, 64 * 7 + 5, [100 * (k + 1) + j for j in range(7)])]} for k in range(2)]
    return {"id": cid, "block_size": 64, "hash_id_scope": "local", "tool_tokens": 64, "system_tokens": 64,
            "requests": [_req(0.0, 64 * 8, list(range(1, 9))), *subs,
                         _req(3.0, 64 * 9 + 10, list(range(1, 10))),
                         _req(4.0, 64 * 20, list(range(1, 21)))]}


@pytest.fixture
def cc_slice(tmp_path):
    d = tmp_path / "cc"
    d.mkdir()
    for cid in ("trace_0001", "trace_0002"):
        (d / f"{cid}.json.gz").write_bytes(gzip.compress(json.dumps(_conversation(cid)).encode()))
    return d


def test_closed_and_open_loop_session_replay(tiny_model_dir, cc_slice, tmp_path):
    dep = start(tiny_model_dir, "cpd")
    try:
        common = dict(url=dep.url, trace=cc_slice, tokens_per_hash_id=4, max_output_tokens=3, quiet=True,
                      tokenizer=str(tiny_model_dir), slo_ttft_s=30.0, slo_tpot_s=5.0, timeout_s=60)
        t0 = time.perf_counter()
        closed = run_bench(users=1, shared_prefix_fraction=1.0, out=tmp_path / "closed.json", **common)
        recs = {r.id: r for r in closed["records"]}
        assert all(r.ok for r in recs.values()), [r.error for r in recs.values() if not r.ok]
        assert len(recs) == 14
        # only one user sends, yet a parent's two subagents run concurrently: each starts before the
        # other's last request finished (the bench's own send/finish times, not a sampled gauge)
        for c in ("trace_0001", "trace_0002"):
            starts = [recs[f"{c}/a{k}#0"].send_s for k in range(2)]
            ends = [recs[f"{c}/a{k}#1"].send_s + recs[f"{c}/a{k}#1"].e2e_s for k in range(2)]
            assert max(starts) < min(ends), (c, starts, ends)
        for c in ("trace_0001", "trace_0002"):
            end = max(recs[f"{c}/a{k}#1"].send_s + recs[f"{c}/a{k}#1"].e2e_s for k in range(2))
            assert recs[f"{c}#1"].send_s >= end  # the parent waits for its subagents
        assert recs["trace_0002#0"].send_s >= recs["trace_0001#2"].send_s + recs["trace_0001#2"].e2e_s
        kinds = closed["summary"]["kinds"]
        assert set(kinds) == {"cold", "warm_small", "subagent"} and kinds["subagent"]["requests"] == 8
        assert kinds["cold"]["ttft"]["p90"] is not None and kinds["subagent"]["goodput"] is not None
        saved = json.loads((tmp_path / "closed.json").read_text())["config"]
        assert saved["users"] == 1 and saved["shared_prefix_fraction"] == 1.0 and saved["trace_format"] == "claude_code"
        assert "closed loop" in saved["arrival_model"]
        # the second conversation's first turn hits the shared prefix (128 tool+system tokens = 2 blocks)
        assert recs["trace_0002#0"].reuse == pytest.approx(128 / 512)

        opened = run_bench(session_rate=0.5, seed=1, **common)
        ok = [r for r in opened["records"] if r.ok]
        assert len(ok) == 14
        lag = [r.sched_lag_s for r in opened["records"]]
        assert max(lag) < 1.0  # sent on schedule (generous bound for a loaded 2-core machine)
        first = {r.id: r.arrival_s for r in opened["records"]}
        assert first["trace_0001#1"] - first["trace_0001#0"] == pytest.approx(3.0)  # in-session t kept
        assert time.perf_counter() - t0 < 60
        assert_no_leaks(dep)
    finally:
        dep.stop()
