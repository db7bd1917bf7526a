"""The router SIGKILLed while requests are in flight on every kind of worker (real supervised
deployment of modeled workers, real HTTP): a long prefill on a prefill-side worker, streaming
decodes on the decode worker, and a prefill whose handoff is staged but not yet fetched.

Expected: the clients get a transport error (their connection is gone; nothing to recover
them without a second router), the workers keep running and free every block of the
abandoned requests — a prefill or decode on disconnect, a staged handoff at the latest after
``handoff.reclaim_after_s`` — so every pool is back to baseline; the restarted router serves the
same prompts with the tokens an undisturbed run gives.
"""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from deploy_util import assert_no_leaks, random_prompt, signal_pid, start, wait_pools_idle

SHAPE, GPU = "llama-3.1-8b", "b200"
RECLAIM_S = 3.0
SETTINGS = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
            "engine.time_dilation": 20.0, "engine.num_blocks": 2048, "handoff.arena_bytes": 16 << 20,
            "handoff.reclaim_after_s": RECLAIM_S}


@pytest.fixture
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "cpd", settings=SETTINGS, supervise=True, restart_backoff_s=0.5)
    yield d
    d.stop()


def _send(dep, prompt: list[int], max_tokens: int, out: dict, stream: bool) -> None:
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    out["events"] = 0
    try:
        with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                out["events"] += line.startswith("data: ")
        out["status"] = r.status_code
    except httpx.HTTPError as e:
        out["error"] = type(e).__name__


def _in_use(dep) -> dict[str, int]:
    return {w: s["num_in_use"] for w, s in dep.pool_stats().items()}


def _num_staged(dep) -> int:
    """Handoffs staged on the prefill-side workers (the senders)."""
    auth = dep.internal_client_auth()
    loads = [httpx.get(f"{w['url']}/load", timeout=5, auth=auth).json() for w in dep.workers if w["role"] != "decode"]
    return sum((load.get("handoff") or {}).get("num_staged", 0) for load in loads)


def _oracle(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    eng = Engine(None, num_blocks=1024, executor=build_modeled_executor(SHAPE, GPU, 1, served_model_dir=model_dir))
    return eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_router_killed_mid_prefill_and_mid_decode_leaks_nothing(dep, tiny_model_dir):
    decodes = [(random_prompt(7100 + i, 300), {}) for i in range(3)]
    threads = [threading.Thread(target=_send, args=(dep, p, 400, o, True), daemon=True) for p, o in decodes]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(o.get("events", 0) >= 5 for _, o in decodes):
        time.sleep(0.05)
    assert all(o.get("events", 0) >= 5 for _, o in decodes), decodes
    assert _in_use(dep)["d0"] > 0  # the decodes hold blocks
    d0 = next(w for w in dep.workers if w["role"] == "decode")
    signal_pid(d0["pid"], signal.SIGSTOP)  # the next prefill's handoff stays staged, unfetched
    try:
        staged_out: dict = {}
        threads.append(threading.Thread(target=_send, args=(dep, random_prompt(7300, 300), 50, staged_out, True),
                                        daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _num_staged(dep) == 0:
            time.sleep(0.05)
        assert _num_staged(dep) > 0, "no handoff staged"
        long_prompt, long_out = random_prompt(7200, 12000), {}
        threads.append(threading.Thread(target=_send, args=(dep, long_prompt, 1, long_out, False), daemon=True))
        threads[-1].start()
        time.sleep(0.3)  # its prefill under way
        assert "status" not in long_out
        workers_before = {k: v for k, v in dep.pids().items() if k != "router"}
        dep.kill_router()
    finally:
        signal_pid(d0["pid"], signal.SIGCONT)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a client hung on the killed router"
    assert all("error" in o for _, o in decodes) and "error" in long_out and "error" in staged_out
    assert {k: v for k, v in dep.pids().items() if k != "router"} == workers_before  # no worker restarted
    stats = wait_pools_idle(dep, timeout_s=RECLAIM_S + 20)
    assert all(s["num_in_use"] == 0 for s in stats.values()), f"blocks of the abandoned requests kept: {stats}"
    deadline = time.monotonic() + RECLAIM_S + 5  # nobody releases it (router dead): the sender's reclaim, on its timer
    while _num_staged(dep) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _num_staged(dep) == 0, "a staged handoff outlived reclaim_after_s"
    dep.wait_ready(120)
    for prompt in (decodes[0][0], long_prompt):
        body = {"model": dep.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, 8)
    assert_no_leaks(dep)
