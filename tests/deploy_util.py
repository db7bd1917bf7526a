"""Helpers for tests that run whole deployments (real processes, real HTTP)."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Sequence, TypeVar

import httpx
import numpy as np

from cpd.config import build_config
from cpd.deploy import Deployment

# Keyword names of start() -> configuration keys (cpd.config); the rest go to Deployment().
START_KEYS = {"topology": "deployment.topology", "num_pre_prefill": "deployment.num_pre_prefill",
              "num_prefill": "deployment.num_prefill", "num_decode": "deployment.num_decode",
              "kv_store": "kv.l3_url", "l3_chunk_blocks": "kv.l3_chunk_blocks", "num_blocks": "engine.num_blocks",
              "host_kv_bytes": "kv.host_kv_bytes", "block_size": "engine.block_size",
              "max_num_seqs": "engine.max_num_seqs", "max_num_batched_tokens": "engine.max_num_batched_tokens",
              "torch_threads": "engine.torch_threads", "handoff_force_tcp": "handoff.force_tcp",
              "cold_threshold": "router.cold_threshold", "max_in_flight": "router.max_in_flight",
              "max_decode_per_worker": "router.max_decode_per_worker", "supervise": "deployment.supervise",
              "restart_backoff_s": "deployment.restart_backoff_s", "api_keys": "auth.api_keys",
              "api_key_files": "auth.api_key_files"}


def start(model_dir: str, topology: str = "cpd", kv_store: str = "", **kw) -> Deployment:
    """A started deployment of ``model_dir`` with test-sized pools (256 L1 blocks, 16 MiB L2, one
    torch thread, a free router port, no supervision unless asked). Keywords: :data:`START_KEYS`,
    plus ``extra_env``, ``worker_extra_args``, ``internal_secret`` (given to every child as
    ``$CPD_INTERNAL_SECRET``) and ``settings`` (any other keys, dotted: ``{"router.routing_mode":
    "adaptive"}``).

    Routing is pinned to ``static`` here (the product's default is ``adaptive``): the tests that
    use this helper check paths through the static pools (cold on pre-prefill, warm on prefill);
    the adaptive tests pass ``settings={"router.routing_mode": "adaptive"}``."""
    settings = {"topology": topology, "kv_store": kv_store, "num_blocks": 256, "host_kv_bytes": 16 << 20,
                "torch_threads": 1, "supervise": False}
    settings.update({k: kw.pop(k) for k in list(kw) if k in START_KEYS})
    overrides = {START_KEYS[k]: v for k, v in settings.items()}
    overrides.update({"model.dir": str(model_dir), "router.port": 0, "router.routing_mode": "static",
                      **kw.pop("settings", {})})
    extra_env = dict(kw.pop("extra_env", {}))
    if kw.get("internal_secret"):
        extra_env["CPD_INTERNAL_SECRET"] = kw.pop("internal_secret")
    kw.pop("internal_secret", None)
    return Deployment(build_config(overrides=overrides), extra_env=extra_env, **kw).start()


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
    auth = dep.internal_client_auth()
    for w in dep.alive_workers():  # handoff staging memory released too
        r = httpx.get(f"{w['url']}/load", timeout=5, auth=auth)
        r.raise_for_status()
        load = r.json()
        if load.get("handoff"):
            assert load["handoff"].get("num_staged", 0) == 0, f"{w['worker_id']} handoff not released: {load['handoff']}"


def complete(dep: Deployment, prompt_ids: list[int], max_tokens: int = 12, **extra) -> dict:
    body = {"model": dep.model_name, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    r = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_completion(dep: Deployment, prompt: list[int], max_tokens: int, out: dict) -> None:
    """Stream a greedy completion; ``out``: ``id``, ``chunks`` (text per event), ``finish``, ``error``
    (filled as events arrive, so another thread can watch the stream's progress)."""
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    out["chunks"], out["finish"], out["error"] = [], None, None
    with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                out["error"] = msg["error"]
                continue
            out.setdefault("id", msg["id"])
            choice = msg["choices"][0]
            out["chunks"].append(choice.get("text") or "")
            out["finish"] = choice.get("finish_reason") or out["finish"]


def routing_record(dep: Deployment, request_id: str) -> dict:
    return httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[request_id]


def random_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn (seeded) from the ordinary-token range of the SmolLM2 vocabulary."""
    return [int(x) for x in np.random.default_rng(seed).integers(10, 40000, size=n)]


def oracle_tokens(model_dir: str, prompt: list[int], max_tokens: int, dtype: str = "auto",
                  batch_invariant: bool = False) -> list[int]:
    """Greedy tokens of one plain in-process engine running the prompt alone (docs/architecture.md oracle),
    at the dtype the deployed workers run (``engine.dtype``, default auto), in their mode
    (``engine.batch_invariant``) and on one torch thread, as :func:`start` runs them (a BLAS may split
    a call's sum among threads, so the thread count can change the last bits in the ordinary mode)."""
    import torch

    from cpd.engine.dtype import resolve_dtype
    from cpd.engine.engine import Engine
    from cpd.engine.sampling import SamplingParams
    num_blocks = max(64, -(-(len(prompt) + max_tokens) // 16) + 1)  # room for the whole sequence
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(model_dir, num_blocks=num_blocks, dtype=resolve_dtype(dtype), batch_invariant=batch_invariant)
        return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    finally:
        torch.set_num_threads(threads)


def signal_pid(pid: int, sig) -> None:
    """Send ``sig`` to a worker process (one that is gone already: nothing)."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def router_workers(dep: Deployment) -> dict:
    """The router's ``/cpd/workers`` view."""
    return httpx.get(f"{dep.url}/cpd/workers", timeout=5).json()


def wait_all_healthy(dep: Deployment, timeout_s: float = 30.0) -> None:
    """Until the router sees every live worker healthy again (AssertionError after ``timeout_s``)."""
    alive = {w["worker_id"] for w in dep.alive_workers()}
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        ws = router_workers(dep)
        if all(ws[w]["healthy"] for w in alive):
            return
        time.sleep(0.2)
    raise AssertionError(f"workers not healthy again: {router_workers(dep)}")


def busy_worker(dep: Deployment, role: str, timeout_s: float = 20.0) -> str:
    """The worker of ``role`` the router has dispatched a request to (running_requests > 0)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for wid, w in router_workers(dep).items():
            if w["role"] == role and w["running_requests"] > 0:
                return wid
        time.sleep(0.02)
    raise AssertionError(f"no {role} worker got the request")


Item = TypeVar("Item")


def staggered_requests(send: Callable[[Item], list[int]], prompts: Sequence[Item], stagger_s: float = 0.05,
                       join_s: float = 180.0) -> dict[int, tuple[float, list[int] | str]]:
    """Keep a worker busy: ``send(prompt)`` (returns the tokens) for every prompt at once, one thread
    each, started ``stagger_s`` apart in order (long prompts first queue the short ones behind them).
    Returns ``{index: (seconds, tokens or the error's text)}``; a request still running after
    ``join_s`` is missing from it. A prompt is whatever ``send`` takes (token ids, or a key)."""
    results: dict[int, tuple[float, list[int] | str]] = {}

    def run(i: int) -> None:
        t0 = time.monotonic()
        try:
            tokens: list[int] | str = send(prompts[i])
        except Exception as e:  # the test compares: an error is a wrong answer, with its text
            tokens = str(e)
        results[i] = (time.monotonic() - t0, tokens)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(stagger_s)
    deadline = time.monotonic() + join_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return results
