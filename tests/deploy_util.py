"""Helpers for tests that run whole deployments (real processes, real HTTP)."""
from __future__ import annotations

import time

import httpx
import numpy as np

from cpd.deploy import Deployment, DeploymentConfig


def start(model_dir: str, topology: str = "cpd", kv_store: str = "", **kw) -> Deployment:
    cfg = DeploymentConfig(model_dir=str(model_dir), topology=topology,
                           num_pre_prefill=kw.pop("num_pre_prefill", 1 if topology == "cpd" else 0),
                           num_prefill=kw.pop("num_prefill", 1 if topology == "cpd" else 2),
                           num_decode=kw.pop("num_decode", 1), kv_store=kv_store,
                           num_blocks=kw.pop("num_blocks", 256), host_kv_bytes=kw.pop("host_kv_bytes", 16 << 20),
                           torch_threads=1, **kw)
    return Deployment(cfg).start()


def wait_pools_idle(dep: Deployment, timeout_s: float = 10.0) -> dict:
    """Poll until every worker's pool has no block in use; returns the last stats."""
    deadline = time.time() + timeout_s
    stats = {}
    while time.time() < deadline:
        stats = dep.pool_stats()
        if all(s["num_in_use"] == 0 for s in stats.values()):
            return stats
        time.sleep(0.1)
    return stats


def assert_no_leaks(dep: Deployment) -> None:
    stats = wait_pools_idle(dep)
    leaked = {w: s for w, s in stats.items() if s["num_in_use"] != 0}
    assert not leaked, f"blocks still in use after the test: {leaked}"
    for w in dep.alive_workers():  # handoff staging memory released too
        load = httpx.get(f"{w['url']}/load", timeout=5).json()
        if load.get("handoff"):
            assert load["handoff"].get("num_staged", 0) == 0, f"{w['worker_id']} handoff not released: {load['handoff']}"


def complete(dep: Deployment, prompt_ids: list[int], max_tokens: int = 12, **extra) -> dict:
    body = {"model": dep.model_name, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    r = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def routing_record(dep: Deployment, request_id: str) -> dict:
    return httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[request_id]


def random_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn (seeded) from the ordinary-token range of the SmolLM2 vocabulary."""
    return [int(x) for x in np.random.default_rng(seed).integers(10, 40000, size=n)]


def oracle_tokens(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one plain in-process engine running the prompt alone (DESIGN §4 oracle)."""
    from cpd.engine.engine import Engine
    from cpd.engine.sampling import SamplingParams
    num_blocks = max(64, -(-(len(prompt) + max_tokens) // 16) + 1)  # room for the whole sequence
    return Engine(model_dir, num_blocks=num_blocks).generate(
        prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
