"""Per-request cost of authentication (issue 12): client API keys at the router plus the signed
router→worker calls and the handoff TCP challenge, side by side in one run.

1. Micro: HMAC signing + verification of one internal call (µs), for a typical prefill body.
2. Live: two tiny-model deployments (cpd topology, TCP handoff), one open and one with an API key
   and an internal secret, started one after the other; the same sequential requests against each
   (alternating rounds, median latency); the ratio secured / open is the overhead.

    .venv/bin/python benchmarks/bench_auth.py [--requests 40] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from cpd.auth import sign, verify
from cpd.config import build_config
from cpd.deploy import Deployment

KEY = "sk-bench"


def micro_sign_verify_us(body_bytes: int = 4096, n: int = 20000) -> float:
    body = b"x" * body_bytes
    secret = b"s" * 32
    t0 = time.perf_counter()
    for i in range(n):
        sig = sign(secret, "POST", "/prefill", body, 1_700_000_000)
        assert verify(secret, "POST", "/prefill", body, "1700000000", sig, 1_700_000_000) is None
    return (time.perf_counter() - t0) / n * 1e6


def _deployment(model_dir: str, secured: bool) -> Deployment:
    overrides = {"model.dir": model_dir, "router.port": 0, "engine.num_blocks": 256, "kv.host_kv_bytes": 16 << 20,
                 "engine.torch_threads": 1, "deployment.supervise": False, "handoff.force_tcp": True}
    env = {}
    if secured:
        overrides["auth.api_keys"] = [KEY]
        env["CPD_INTERNAL_SECRET"] = "bench-secret"
    return Deployment(build_config(overrides=overrides), extra_env=env).start()


def _round(dep: Deployment, headers: dict, prompts: list[list[int]]) -> list[float]:
    out = []
    for p in prompts:
        body = {"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        r = httpx.post(f"{dep.url}/v1/completions", json=body, headers=headers, timeout=60)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return out


def live(model_dir: str, n: int) -> dict:
    rng = np.random.default_rng(0)
    deps = {"open": _deployment(model_dir, False), "secured": _deployment(model_dir, True)}
    headers = {"open": {}, "secured": {"Authorization": f"Bearer {KEY}"}}
    times: dict[str, list[float]] = {k: [] for k in deps}
    try:
        for k in deps:  # warm-up
            _round(deps[k], headers[k], [list(map(int, rng.integers(10, 40000, 64))) for _ in range(3)])
        for _ in range(4):  # alternate rounds so that machine noise hits both alike
            prompts = [list(map(int, rng.integers(10, 40000, 64))) for _ in range(max(1, n // 4))]
            for k in deps:
                times[k] += _round(deps[k], headers[k], prompts)
    finally:
        for d in deps.values():
            d.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"requests_each": len(times["open"]), "median_s": med, "ratio_secured_over_open": med["secured"] / med["open"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--model", default="", help="model dir (default: a tiny random Llama made here)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    model_dir = a.model
    if not model_dir:
        from cpd.engine.weights import make_tiny_llama_dir
        model_dir = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "tiny", seed=0))
    res = {"sign_plus_verify_us_per_call_4KiB": micro_sign_verify_us(), **live(model_dir, a.requests)}
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
