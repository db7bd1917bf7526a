"""End-to-end `cpd bench` replay against a real OpenAI-compatible HTTP peer (FastAPI + uvicorn).

The peer (defined here, test-only) serves ``/v1/models`` and streaming ``/v1/completions``: after
``FIRST_DELAY`` it streams deterministic tokens ``STEP`` apart, reports usage with a 16-token
block prefix cache, answers 400 to ``max_tokens == 13``, stalls before the first token for
``max_tokens == 7`` and hangs for ``max_tokens == 11``.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from cpd.bench import client as bc
from cpd.bench import report
from cpd.bench.cli import app as bench_app
from cpd.bench.trace import Vocab, build_requests, load_mooncake
from tests.conftest import TRACE, free_port

VOCAB, SPECIAL = 1000, [0, 1, 2]
FIRST_DELAY, STEP, STALL = 0.05, 0.004, 0.4
CACHE_BLOCK = 16
MAX_MODEL_LEN = 4096


class Peer:
    def __init__(self) -> None:
        self.received: dict[str, float] = {}  # request key -> perf_counter at receipt
        self.bodies: list[dict] = []
        self.blocks: set[tuple[int, ...]] = set()
        self.app = self._make_app()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _make_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "peer-model", "object": "model",
                                                 "vocab_size": VOCAB, "special_token_ids": SPECIAL,
                                                 "max_model_len": MAX_MODEL_LEN}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            t = time.perf_counter()
            body = await request.json()
            self.bodies.append(body)
            prompt, n = body["prompt"], body["max_tokens"]
            self.received[f"{prompt[:8]}|{n}|{len(prompt)}"] = t
            if n == 13:
                return JSONResponse({"error": {"message": "peer rejects max_tokens=13", "code": 400}}, 400)
            if len(prompt) + n > MAX_MODEL_LEN:
                return JSONResponse({"error": {"message": "context too long"}}, 400)
            if any(not 0 <= x < VOCAB or x in SPECIAL for x in prompt):
                return JSONResponse({"error": {"message": "bad token id"}}, 400)
            assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
            assert body["stream_options"] == {"include_usage": True}
            # prefix cache over full 16-token blocks
            cached, key = 0, ()
            for i in range(len(prompt) // CACHE_BLOCK):
                key = tuple(prompt[: (i + 1) * CACHE_BLOCK])
                if key not in self.blocks:
                    break
                cached += CACHE_BLOCK
            for i in range(len(prompt) // CACHE_BLOCK):
                self.blocks.add(tuple(prompt[: (i + 1) * CACHE_BLOCK]))
            per_chunk = 1 if n <= 32 else 16

            async def gen():
                await asyncio.sleep(FIRST_DELAY + (STALL if n == 7 else 0) + (30 if n == 11 else 0))
                sent = 0
                while sent < n:
                    k = min(per_chunk, n - sent)
                    ids = [(sent + j) % 97 + 3 for j in range(k)]
                    chunk = {"id": "c", "object": "text_completion", "model": "peer-model",
                             "choices": [{"index": 0, "text": "".join(f" t{x}" for x in ids),
                                          "token_ids": ids if k > 1 else None,
                                          "finish_reason": "length" if sent + k == n else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    sent += k
                    await asyncio.sleep(STEP)
                usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        return app


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    server = uvicorn.Server(uvicorn.Config(p.app, host="127.0.0.1", port=p.port, log_level="warning",
                                           access_log=False, lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    # Warm the peer's streaming path once (lazy imports on a fresh venv would otherwise hold the
    # GIL during the first timed requests), then forget it: the prompt has no full block.
    with httpx.stream("POST", f"{p.url}/v1/completions", timeout=30,
                      json={"prompt": [5, 6, 7], "max_tokens": 2, "stream": True, "ignore_eos": True,
                            "temperature": 0, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    p.received.clear()
    p.bodies.clear()
    yield p
    server.should_exit = True
    th.join(10)


def write_trace(path, rows):
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                            for t, i, o, h in rows))
    return path


# (timestamp ms, input_length, output_length, hash_ids)
ROWS = [
    (0, 1000, 20, [0, 1]),
    (0, 1100, 6, [0, 2, 3]),
    (150, 1100, 13, [0, 2, 4]),      # warm 2/3; rejected by the peer (400)
    (150, 1800, 8, [0, 2, 3, 5]),    # warm: 3 of 4 blocks seen
    (300, 1200, 7, [0, 6, 9]),       # stalls STALL before its first token
    (400, 1100, 40, [0, 7, 10]),     # multi-token chunks (16 per chunk)
    (450, 1200, 20, [0, 1, 8]),      # warm 2/3
    (600, 1900, 1, [0, 2, 3, 5]),    # warm, a single output token
]


def test_replay_records_errors_and_arrivals(peer, tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", ROWS)
    reqs = build_requests(load_mooncake(trace), Vocab(VOCAB, tuple(SPECIAL)), tokens_per_hash_id=16)
    peer.received.clear()
    res = bc.run_replay(peer.url + "/v1/", reqs, timeout_s=10)
    assert res.model == "peer-model"
    recs = {r.id: r for r in res.records}
    assert [r.id for r in res.records] == [f"r{i}" for i in range(len(ROWS))]
    # errors: exactly the rejected request, with status and message
    bad = recs["r2"]
    assert bad.error == "HTTP 400: peer rejects max_tokens=13" and bad.status == 400 and bad.ttft_s is None
    assert [r.id for r in res.records if not r.ok] == ["r2"]
    for r, q in zip(res.records, reqs):
        assert r.trace_class == q.trace_class and r.prompt_len == q.prompt_len
        if not r.ok:
            continue
        assert r.status == 200 and r.output_tokens == q.max_tokens and r.prompt_tokens == q.prompt_len
        assert r.finish_reason == "length"
        assert r.ttft_s >= FIRST_DELAY and r.e2e_s >= r.ttft_s
        if q.max_tokens > 1:
            assert r.tpot_s == pytest.approx(sum(r.itls_s) / (r.output_tokens - 1))
            assert q.max_tokens > 32 or r.tpot_s >= STEP * 0.9
        else:
            assert r.tpot_s is None and r.itls_s == []
    assert len(recs["r0"].itls_s) == 19 and recs["r0"].streamed_tokens == 20
    assert recs["r5"].streamed_tokens == 40 and len(recs["r5"].itls_s) == 2  # 16+16+8 tokens in 3 chunks
    assert recs["r4"].ttft_s >= FIRST_DELAY + STALL
    assert [r.trace_class for r in res.records] == ["cold", "cold", "warm", "warm", "cold", "cold", "warm", "warm"]
    # the peer's prefix cache: r3 repeats r1's two full 16-token blocks (r1's 3rd block is 2 tokens)
    assert recs["r1"].prompt_len == 34
    assert recs["r3"].cached_tokens == 32 and recs["r0"].cached_tokens == 0
    # open loop: every request was sent (and received) at its scheduled arrival, the stalled
    # request r4 did not delay r5
    # (client side, the precise one: sched_lag_s; peer side, coarse: the in-process peer's own request
    # handling can lag on a loaded 2-core machine, which says nothing about the replayer)
    t_first = min(peer.received.values())
    for r, q in zip(res.records, reqs):
        assert abs(r.sched_lag_s) < 0.2, (r.id, r.sched_lag_s)  # well under STALL: r4 never holds others
        got = peer.received[f"{q.prompt[:8]}|{q.max_tokens}|{q.prompt_len}"] - t_first
        assert abs(got - q.arrival_s) < 1.0, (r.id, got, q.arrival_s)
    assert recs["r5"].send_s < recs["r4"].send_s + recs["r4"].e2e_s

    s = report.summarize(res.records, res.duration_s, slo_ttft_s=FIRST_DELAY + 0.1, slo_tpot_s=1.0)
    assert s["n"] == 8 and s["ok"] == 7 and s["errors"] == 1 and s["error_kinds"] == {"HTTP 400": 1}
    assert s["classes"] == {"all": 8, "warm": 4, "cold": 4}
    assert s["all"]["n"] == 7 and s["warm"]["n"] == 3 and s["cold"]["n"] == 4
    ttfts = sorted(r.ttft_s for r in res.records if r.ok)
    assert s["all"]["ttft"]["p50"] == pytest.approx(ttfts[3])
    assert s["all"]["ttft"]["mean"] == pytest.approx(sum(ttfts) / 7)
    assert s["all"]["ttft"]["p50"] <= s["all"]["ttft"]["p90"] <= s["all"]["ttft"]["p99"] <= ttfts[-1]
    assert s["slo_met"] == 6  # all ok requests but the stalled one
    assert s["goodput"] == pytest.approx(6 / res.duration_s)
    assert s["request_throughput"] == pytest.approx(7 / res.duration_s)
    assert s["output_throughput"] == pytest.approx(sum(r.output_tokens for r in res.records if r.ok) / res.duration_s)
    ok = [r for r in res.records if r.prompt_tokens]
    assert s["cache_hit_ratio"] == pytest.approx(sum(r.cached_tokens for r in ok) / sum(r.prompt_tokens for r in ok))
    assert 0 < s["cache_hit_ratio"] < 1
    assert s["all"]["itl"]["n"] > 0 and s["all"]["itl"]["p50"] >= STEP * 0.9
    assert 0.6 < res.duration_s < 3

    out = tmp_path / "res.json"
    report.write_results(out, {"label": "x"}, s, res.records)
    doc = report.load_results(out)
    assert doc["label"] == "x" and doc["summary"]["errors"] == 1
    assert [r.to_dict() for r in doc["records"]] == [r.to_dict() for r in res.records]
    png = tmp_path / "cdf.png"
    report.plot_ttft_cdf(res.records, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_concurrency_cap_and_timeout(peer, tmp_path):
    rows = [(0, 600, 7, [0, 1]), (0, 600, 3, [0, 2]), (50, 600, 11, [0, 3]), (60, 600, 2, [0, 4])]
    reqs = build_requests(load_mooncake(write_trace(tmp_path / "t.jsonl", rows)), Vocab(VOCAB, tuple(SPECIAL)),
                          tokens_per_hash_id=4)
    res = bc.run_replay(peer.url, reqs, model="peer-model", max_concurrency=1, timeout_s=1.0)
    r0, r1, r2, r3 = res.records
    assert r0.ok and r1.ok and r3.ok
    assert r2.error is not None and r2.error.startswith("timeout") and r2.e2e_s == pytest.approx(1.0, abs=0.2)
    # closed by the cap: r1 waits for r0 (which stalls), r3 waits for r2's timeout
    assert r1.sched_lag_s >= STALL
    assert r1.send_s >= r0.send_s + r0.e2e_s - 0.01
    assert r3.send_s >= r2.send_s + 1.0 - 0.01
    s = report.summarize(res.records, res.duration_s)
    assert s["errors"] == 1 and s["error_kinds"] == {"timeout": 1} and s["goodput"] is None


def test_connection_error_is_recorded():
    reqs = build_requests([load_mooncake(TRACE, 0, 1)[0]], Vocab(VOCAB, tuple(SPECIAL)), tokens_per_hash_id=2)
    res = bc.run_replay(f"http://127.0.0.1:{free_port()}", reqs, model="m", timeout_s=2)
    assert not res.records[0].ok and "Connect" in res.records[0].error


def test_cli_bench_and_compare(peer, tmp_path):
    root = typer.Typer()
    root.add_typer(bench_app, name="bench")
    runner = CliRunner()
    outs = []
    for label, spread in (("pd", "--bursty-ticks"), ("cpd", "--spread-ticks")):
        out = tmp_path / f"{label}.json"
        args = ["bench", "--url", peer.url, "--trace", str(TRACE), "--max-requests", "12", "--start", "3",
                "--tokens-per-hash-id", "4", "--time-scale", "100", spread, "--max-prompt-tokens", "64",
                "--slo-ttft-s", "1", "--slo-tpot-s", "0.5", "--out", str(out), "--label", label,
                "--plot", str(tmp_path / f"{label}.png"), "--timeout-s", "20"]
        r = runner.invoke(root, args)
        assert r.exit_code == 0, r.output
        assert "TTFT" in r.output
        doc = json.loads(out.read_text())
        assert doc["config"]["label"] == label and doc["config"]["vocab_size"] == VOCAB
        assert doc["config"]["arrival_mode"] == ("spread_ticks" if label == "cpd" else "bursty_ticks")
        assert doc["config"]["start"] == 3 and doc["config"]["tokens_per_hash_id"] == 4
        assert doc["config"]["context_len"] == MAX_MODEL_LEN  # from the model card
        # rows 3..14 of the trace: no output_length is 13, so the peer accepts all
        assert doc["summary"]["n"] == 12 and doc["summary"]["errors"] == 0
        assert [r["line"] for r in doc["records"]] == list(range(3, 15))
        assert all(r["prompt_len"] <= 64 for r in doc["records"])
        outs.append(out)
    r = runner.invoke(root, ["bench", "run", "--url", peer.url, "--trace", str(TRACE), "--max-requests", "2",
                             "--tokens-per-hash-id", "2", "--time-scale", "100"])
    assert r.exit_code == 0, r.output
    # full-size blocks: row 11 (87,169 prompt tokens) only fits after the context cap
    out = tmp_path / "ctx.json"
    r = runner.invoke(root, ["bench", "--url", peer.url, "--trace", str(TRACE), "--start", "11",
                             "--max-requests", "1", "--out", str(out), "-q"])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())["records"][0]
    assert rec["error"] is None and rec["prompt_len"] == 3584 and rec["prompt_len"] + 402 <= MAX_MODEL_LEN
    png = tmp_path / "cmp.png"
    r = runner.invoke(root, ["bench", "compare", *map(str, outs), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "pd" in r.output and "cpd" in r.output and png.stat().st_size > 0
    r = runner.invoke(root, ["bench"])
    assert r.exit_code == 2 and "--url" in r.output
