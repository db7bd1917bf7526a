"""An admitted request is never refused by admission on its retry (adaptive routing, SLO-predictive
admission on): real worker processes of the tiny model, real HTTP, a real SIGKILL.

SLO-predictive admission (``--admission-factor``, rule A6) answers 429 "overloaded; retry later"
to a *new* request. A request it admitted, whose prefill worker then dies, is retried on the next
choice (issue 7 §3): that retry is the server's recovery, not a new arrival, so admission must not
turn the server's fault into a 429 for the client (nor a re-prefill after the first token into a
mid-stream 429). It is dispatched on the next choice and waits its turn there.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from deploy_util import assert_no_leaks, complete, oracle_tokens, random_prompt, start


def _running(dep) -> dict[str, int]:
    ws = httpx.get(f"{dep.url}/cpd/workers", timeout=5).json()
    return {k: w["running_requests"] for k, w in ws.items() if w["role"] == "prefill"}


def _wait_running(dep, total: int, timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.time() + timeout_s
    running = _running(dep)
    while time.time() < deadline and sum(running.values()) < total:
        time.sleep(0.05)
        running = _running(dep)
    assert sum(running.values()) == total, running
    return running


def _metric(dep, name: str) -> float:
    text = httpx.get(f"{dep.url}/metrics", timeout=5).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith((f"{name} ", f"{name}{{")))


def test_retry_after_a_worker_dies_is_not_refused_by_admission(tiny_model_dir):
    """pd, 2 prefill workers, a tiny TTFT SLO, factor 1.5. Both prefill workers are stopped;
    request A queues on one, request B (admitted: the other is idle) on the other; B's worker is
    SIGKILLed. B's retry lands on A's worker, whose queue puts it past the admission bound: it
    must still be served there (the oracle's tokens), not answered 429. float32: B is prefilled beside
    A on one worker (a shared step budget), and in the ordinary mode only float32 keeps its tokens
    whatever ran beside it (docs/architecture.md, correctness oracle)."""
    dep = start(tiny_model_dir, "pd", num_prefill=2,
                settings={"engine.dtype": "float32", "router.routing_mode": "adaptive", "router.ttft_slo_s": 0.001,
                          "router.admission_factor": 1.5})
    try:
        pids = dep.pids()
        prompt_a, prompt_b = random_prompt(401, 1500), random_prompt(402, 1500)
        expected_b = oracle_tokens(tiny_model_dir, prompt_b, 4, dtype="float32")
        for wid in ("p0", "p1"):
            os.kill(pids[wid], signal.SIGSTOP)
        out: dict = {}

        def send(name: str, prompt: list[int]) -> None:
            body = {"model": dep.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            out[name] = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)

        try:
            t_a = threading.Thread(target=send, args=("a", prompt_a))
            t_a.start()
            holder_a = next(k for k, n in _wait_running(dep, 1).items() if n)
            t_b = threading.Thread(target=send, args=("b", prompt_b))
            t_b.start()
            holder_b = next(k for k, n in _wait_running(dep, 2).items() if n and k != holder_a)
            dep.kill_worker(holder_b)
            time.sleep(1.0)  # B's retry is decided while A still sits on its (stopped) worker
        finally:
            for wid in ("p0", "p1"):
                try:
                    os.kill(pids[wid], signal.SIGCONT)
                except ProcessLookupError:
                    pass
        t_a.join(120)
        t_b.join(120)
        assert out["a"].status_code == 200, out["a"].text
        assert out["b"].status_code == 200, out["b"].text  # before the fix: 429 slo_admission
        assert out["b"].json()["choices"][0]["token_ids"] == expected_b
        assert _metric(dep, "cpd_admission_rejected_total") == 0
        # the deployment still admits (and refuses) new requests as before
        assert len(complete(dep, random_prompt(403, 40), 2)["choices"][0]["token_ids"]) == 2
        assert_no_leaks(dep)
    finally:
        dep.stop()
