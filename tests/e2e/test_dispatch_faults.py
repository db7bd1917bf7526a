"""Issue 7 §1, §3, §4 on a live deployment (pd: 2 prefill, 2 decode workers; real processes,
real SIGSTOP / SIGKILL): a late handoff never decodes over another request's KV, every
router→worker wait is bounded, and a retry goes to another worker.

Order matters: the last two tests SIGKILL a worker each.

The deployment runs float32: a retried or re-prefilled request may be computed beside another
(the two B requests of the late-handoff test decode together, A is re-prefilled beside them),
and in the ordinary mode only float32 keeps its tokens whatever ran beside it
(docs/architecture.md, correctness oracle; bf16 flips a greedy token now and then).
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from deploy_util import (assert_no_leaks, busy_worker, oracle_tokens, random_prompt, signal_pid, start,
                         wait_all_healthy)

MAX_TOKENS = 8
RECLAIM_S = 2.0  # prefill side: stagings nobody released are reclaimed after this
# Router bounds (CPD_DISPATCH_TIMEOUTS): a prefill's headers ≤ 2 + 4 s, then ≤ 4 s between its
# progress lines (sent every 0.5 s); decode headers ≤ 8 s (+ transfer term, negligible here);
# ≤ 3 s between NDJSON lines (heartbeats every 0.5 s).
TIMEOUTS = {"connect_s": 2.0, "prefill_idle_s": 4.0, "decode_floor_s": 8.0, "decode_idle_s": 3.0}
SLACK_S = 15.0  # the rest of a request (a prefill and a decode on a loaded 2-core machine)


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=2, num_decode=2, settings={"engine.dtype": "float32"},
              worker_extra_args=["--handoff-reclaim-after-s", str(RECLAIM_S)],
              extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps(TIMEOUTS)})
    yield d
    for w in d.workers:  # never leave a stopped process behind
        signal_pid(w["pid"], signal.SIGCONT)
    d.stop()


@pytest.fixture(autouse=True)
def _healthy_before_and_no_leaks_after(dep):
    wait_all_healthy(dep)
    yield
    for w in dep.workers:
        signal_pid(w["pid"], signal.SIGCONT)
    assert_no_leaks(dep)


def _oracle(model_dir: str, prompt: list[int]) -> list[int]:
    return oracle_tokens(model_dir, prompt, MAX_TOKENS, dtype="float32")


def _worker(dep, wid: str) -> dict:
    return next(w for w in dep.workers if w["worker_id"] == wid)


def _post(dep, prompt, max_tokens=MAX_TOKENS, **extra) -> httpx.Response:
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    return httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)


class _Async:
    """Send one completion in a thread; ``result()`` joins it."""

    def __init__(self, dep, prompt, max_tokens=MAX_TOKENS, **extra):
        self.t0 = time.time()
        self.resp: httpx.Response | None = None
        self.elapsed_s = None

        def run():
            self.resp = _post(dep, prompt, max_tokens, **extra)
            self.elapsed_s = time.time() - self.t0
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout_s: float = 120.0) -> httpx.Response:
        self.thread.join(timeout_s)
        assert self.resp is not None, "request did not end"
        return self.resp


def _staged_shm(dep) -> int:
    return sum(httpx.get(f"{w['url']}/load", timeout=5).json()["handoff"]["staged_shm"]
               for w in dep.alive_workers() if w["role"] != "decode")


def _wait_staged(dep, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.time() + timeout_s
    while _staged_shm(dep) < n:
        assert time.time() < deadline, "prefill never staged the handoff"
        time.sleep(0.05)


def _stale_detected(dep) -> int:
    return sum(httpx.get(f"{w['url']}/load", timeout=5).json()["handoff_received"]["stale_detected"]
               for w in dep.alive_workers() if w["role"] == "decode")


def _tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _assert_clear_error_or_oracle(resp: httpx.Response, want: list[int]) -> None:
    if resp.status_code == 200:
        assert resp.json()["choices"][0]["token_ids"] == want, "decoded over foreign KV"
    else:
        assert resp.status_code in (502, 503, 504) and "error" in resp.json(), resp.text


# ---- §1: a late handoff never reads another request's KV ----------------------------------

def test_late_handoff_after_reclaim_and_restage_is_never_decoded(dep, tiny_model_dir):
    """Both decode workers stopped: request A is prefilled and staged, its decode waits past
    the staging's lifetime; B (same length, so the same arena region) is staged after A's is
    reclaimed. On SIGCONT, A's handle names a region that holds B's KV: A must be re-prefilled
    (oracle tokens) or fail clearly — the old code answered 200 with B's continuation."""
    a, b = random_prompt(701, 96), random_prompt(702, 96)
    want_a, want_b = _oracle(tiny_model_dir, a), _oracle(tiny_model_dir, b)
    decoders = [w for w in dep.alive_workers() if w["role"] == "decode"]
    staged0, stale0 = _staged_shm(dep), _stale_detected(dep)
    for w in decoders:
        signal_pid(w["pid"], signal.SIGSTOP)
    try:
        ra = _Async(dep, a, min_tokens=MAX_TOKENS)  # the re-prefill's own sampling must stay valid
        _wait_staged(dep, staged0 + 1)
        time.sleep(RECLAIM_S + 0.3)  # A's staging is now past its lifetime
        rb = [_Async(dep, b), _Async(dep, b)]  # one per prefill worker: one lands on A's region
        _wait_staged(dep, staged0 + 3)
    finally:
        for w in decoders:
            signal_pid(w["pid"], signal.SIGCONT)
    _assert_clear_error_or_oracle(ra.result(), want_a)
    assert ra.resp.status_code == 200  # with a second chance it is re-prefilled, not failed
    for r in rb:
        assert _tokens(r.result()) == want_b
    assert _stale_detected(dep) > stale0  # the decode worker refused A's stale handle


# ---- §3: bounded time, retried elsewhere before the first token -----------------------------

def test_prefill_worker_stopped_request_retried_within_bound(dep, tiny_model_dir):
    prompt = random_prompt(711, 120)
    want = _oracle(tiny_model_dir, prompt)
    prefills = [w for w in dep.alive_workers() if w["role"] == "prefill"]
    for w in prefills:
        signal_pid(w["pid"], signal.SIGSTOP)
    r = _Async(dep, prompt)
    stopped = busy_worker(dep, "prefill")
    for w in prefills:  # the others run again; the one holding the request stays stopped
        if w["worker_id"] != stopped:
            signal_pid(w["pid"], signal.SIGCONT)
    resp = r.result()
    assert _tokens(resp) == want
    bound = TIMEOUTS["connect_s"] + TIMEOUTS["prefill_idle_s"] + SLACK_S  # stopped: its headers never come
    assert r.elapsed_s < bound, (r.elapsed_s, bound)
    rec = httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[resp.json()["id"]]
    assert rec["prefill_worker"] != stopped


def test_decode_worker_stopped_before_first_token_retried_elsewhere(dep, tiny_model_dir):
    prompt = random_prompt(721, 100)
    want = _oracle(tiny_model_dir, prompt)
    decoders = [w for w in dep.alive_workers() if w["role"] == "decode"]
    for w in decoders:
        signal_pid(w["pid"], signal.SIGSTOP)
    r = _Async(dep, prompt)
    stopped = busy_worker(dep, "decode")
    for w in decoders:
        if w["worker_id"] != stopped:
            signal_pid(w["pid"], signal.SIGCONT)
    resp = r.result()
    assert _tokens(resp) == want
    assert r.elapsed_s < TIMEOUTS["decode_floor_s"] + SLACK_S, r.elapsed_s
    rec = httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[resp.json()["id"]]
    assert rec["decode_worker"] != stopped and rec["decode_failures"]


def test_decode_worker_stopped_mid_stream_ends_with_error_event_within_bound(dep):
    prompt = random_prompt(731, 64)
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    n_events, error, stopped, t_stop = 0, None, None, None
    with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                error = msg["error"]
                continue
            n_events += 1
            if n_events == 3 and stopped is None:  # tokens are flowing: stop its decode worker
                stopped = busy_worker(dep, "decode")
                signal_pid(_worker(dep, stopped)["pid"], signal.SIGSTOP)
                t_stop = time.time()
    took = time.time() - t_stop
    assert stopped is not None and error is not None, "the stream must end with an SSE error event"
    assert error["message"] and error["type"]
    assert took < TIMEOUTS["decode_idle_s"] + SLACK_S, took


# ---- §4: a transport failure excludes the worker from the retry ---------------------------

def test_decode_worker_killed_before_first_token_retried_on_the_other(dep, tiny_model_dir):
    prompt = random_prompt(741, 100)
    want = _oracle(tiny_model_dir, prompt)
    decoders = [w for w in dep.alive_workers() if w["role"] == "decode"]
    for w in decoders:
        signal_pid(w["pid"], signal.SIGSTOP)
    r = _Async(dep, prompt)
    victim = busy_worker(dep, "decode")
    for w in decoders:
        if w["worker_id"] != victim:
            signal_pid(w["pid"], signal.SIGCONT)
    dep.kill_worker(victim)  # the router's read fails at once (connection reset), no timeout
    resp = r.result()
    assert _tokens(resp) == want
    assert r.elapsed_s < SLACK_S, r.elapsed_s
    assert httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[resp.json()["id"]]["decode_worker"] != victim


def test_prefill_worker_killed_mid_prefill_retried_on_the_other(dep, tiny_model_dir):
    prompt = random_prompt(751, 120)
    want = _oracle(tiny_model_dir, prompt)
    prefills = [w for w in dep.alive_workers() if w["role"] == "prefill"]
    for w in prefills:
        signal_pid(w["pid"], signal.SIGSTOP)
    r = _Async(dep, prompt)
    victim = busy_worker(dep, "prefill")
    for w in prefills:
        if w["worker_id"] != victim:
            signal_pid(w["pid"], signal.SIGCONT)
    dep.kill_worker(victim)  # mid-prefill: the connection is reset, not refused
    resp = r.result()
    assert _tokens(resp) == want
    assert r.elapsed_s < SLACK_S, r.elapsed_s
    assert httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[resp.json()["id"]]["prefill_worker"] != victim
