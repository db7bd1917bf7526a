"""A worker whose engine fails (not a request: its canary forward fails too) while clients send
(real router, real modeled worker processes, real HTTP; ``pd`` with two prefill workers, the fault
in ``p0`` only: ``CPD_FAULT_WORKER``; then ``pd`` with two decode workers, the fault in ``d0``).

* The request that meets the broken engine is not lost: ``p0`` answers its prefill with
  ``engine_failed`` and the router retries it on ``p1``; the client gets 200 and exact tokens.
* ``p0`` says 503 from that step on, the router routes around it, and idle it probes its own engine
  every ``RETRY_AFTER_S``; the break heals after ``BREAK_S`` (a transient device fault), a probe runs,
  ``p0`` says 200 and is routed to again. No client request is ever the probe.
* On the decode side the same: the decode that meets ``d0``'s broken engine before its first decoded
  token is retried on ``d1`` from the same staging; the client gets 200 and exact tokens.
* Mid-stream (``router.timeouts.max_decode_migrations``): a decode worker (or a decode-local
  append's worker) SIGKILLed or SIGSTOPped
  after tokens have streamed: the request is migrated (its prompt and the tokens so far
  re-prefilled, decoding goes on on the other decode worker); the client's stream ends normally
  with every token the uninterrupted run gives.
"""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.engine.faults import BREAK_ENV, BREAK_S_ENV, WORKER_ENV
from deploy_util import assert_no_leaks, busy_worker, random_prompt, routing_record, signal_pid, start, stream_completion

SHAPE, GPU = "llama-3.1-8b", "b200"
BREAK_SEED, BREAK_S = 4747, 4.0
RETRY_AFTER_S = 0.5  # engine.failed_steps_retry_after_s: an idle failed engine probes this often
SETTINGS = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
            "engine.time_dilation": 10.0, "engine.num_blocks": 2048, "handoff.arena_bytes": 16 << 20,
            "engine.failed_steps_retry_after_s": RETRY_AFTER_S}


@pytest.fixture
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=2, num_decode=1, settings=SETTINGS,
              extra_env={BREAK_ENV: str(BREAK_SEED), BREAK_S_ENV: str(BREAK_S), WORKER_ENV: "p0"})
    yield d
    d.stop()


@pytest.fixture
def dep_decode(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=2, settings=SETTINGS,
              extra_env={BREAK_ENV: str(BREAK_SEED), WORKER_ENV: "d0"})
    yield d
    d.stop()


def _oracle(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    eng = Engine(None, num_blocks=1024, executor=build_modeled_executor(SHAPE, GPU, 1, served_model_dir=model_dir))
    return eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _post(dep, prompt: list[int], max_tokens: int = 6, **sampling) -> httpx.Response:
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **sampling}
    return httpx.post(f"{dep.url}/v1/completions", json=body, timeout=60)


def _health(dep) -> dict[str, dict]:
    return {w["worker_id"]: httpx.get(f"{w['url']}/health", timeout=5).json() for w in dep.workers}


def _router_view(dep) -> dict[str, bool]:
    return {wid: w["healthy"] for wid, w in httpx.get(f"{dep.url}/cpd/workers", timeout=5).json().items()}


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_broken_engine_loses_no_request_is_routed_around_and_comes_back(dep, tiny_model_dir):
    # The trigger request goes wherever the router sends it; send new ones until p0 has met it.
    t_break = None
    for i in range(8):
        prompt = random_prompt(3000 + i, 200)
        r = _post(dep, prompt, temperature=0.5, seed=BREAK_SEED)
        assert r.status_code == 200, r.text  # never lost: retried on p1 when p0's engine failed it
        assert r.json()["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, 6)
        if _health(dep)["p0"]["num_failed_steps"] > 0:
            t_break = time.monotonic()
            assert routing_record(dep, r.json()["id"])["prefill_worker"] == "p1"
            break
    assert t_break is not None, "p0 never met the trigger"
    h = _health(dep)["p0"]
    assert h["status"] == "error" and h["num_failed_requests"] >= 1, h
    _wait_for(lambda: _router_view(dep)["p0"] is False, 10, "the router to mark p0 unhealthy")
    served_meanwhile = []
    while time.monotonic() - t_break < BREAK_S - 1.0:  # p0 still broken: everything goes to p1
        prompt = random_prompt(3100 + len(served_meanwhile), 200)
        r = _post(dep, prompt)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, 6)
        served_meanwhile.append(routing_record(dep, r.json()["id"])["prefill_worker"])
        time.sleep(0.2)
    assert served_meanwhile and set(served_meanwhile) == {"p1"}, served_meanwhile
    failed_probes = _health(dep)["p0"]["consecutive_failed_steps"]
    assert failed_probes >= 2, failed_probes  # the idle worker probed its own engine, and it failed
    _wait_for(lambda: _health(dep)["p0"]["status"] == "ok", BREAK_S + 4 * RETRY_AFTER_S + 10, "p0 to heal")
    _wait_for(lambda: _router_view(dep)["p0"] is True, 10, "the router to route to p0 again")
    assert _health(dep)["p0"]["num_failed_requests"] == h["num_failed_requests"]  # no client request was a probe
    routed = []
    for i in range(6):
        prompt = random_prompt(3200 + i, 200)
        r = _post(dep, prompt)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, 6)
        routed.append(routing_record(dep, r.json()["id"])["prefill_worker"])
    assert "p0" in routed, routed
    assert_no_leaks(dep)


def test_a_decode_that_meets_a_broken_engine_is_retried_on_another_decode_worker(dep_decode, tiny_model_dir):
    dep = dep_decode
    for i in range(8):
        prompt = random_prompt(3300 + i, 200)
        r = _post(dep, prompt, temperature=0.5, seed=BREAK_SEED)
        assert r.status_code == 200, r.text  # never lost: d0's engine failed it, d1 decoded it
        assert r.json()["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, 6)
        if _health(dep)["d0"]["num_failed_steps"] > 0:
            assert routing_record(dep, r.json()["id"])["decode_worker"] == "d1", routing_record(dep, r.json()["id"])
            break
    else:
        raise AssertionError("d0 never met the trigger")
    assert _health(dep)["d0"]["status"] == "error"
    _wait_for(lambda: _router_view(dep)["d0"] is False, 10, "the router to mark d0 unhealthy")
    prompt = random_prompt(3400, 200)
    r = _post(dep, prompt)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, 6)
    assert_no_leaks(dep)


MIGRATION_TIMEOUTS = {"max_decode_migrations": 2, "decode_idle_s": 3.0}


@pytest.fixture
def dep_migrate(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=3,
              settings={**SETTINGS, "engine.time_dilation": 20.0},
              extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps(MIGRATION_TIMEOUTS)})
    yield d
    for w in d.workers:
        signal_pid(w["pid"], signal.SIGCONT)
    d.stop()


def test_a_decode_whose_worker_dies_or_stops_mid_stream_is_migrated_and_ends_exact(dep_migrate, tiny_model_dir):
    """SIGKILL of the decode worker after 10 streamed tokens, then SIGSTOP of the one it moved to
    after 40: the stream moves twice and ends with the uninterrupted run's 120 tokens."""
    dep = dep_migrate
    prompt, max_tokens = random_prompt(3500, 300), 120
    out: dict = {}
    t = threading.Thread(target=stream_completion, args=(dep, prompt, max_tokens, out), daemon=True)
    t.start()
    _wait_for(lambda: len(out.get("chunks", [])) >= 10, 30, "tokens to flow")
    first = routing_record(dep, out["id"])["decode_worker"]
    dep.kill_worker(first)
    _wait_for(lambda: len(out["chunks"]) >= 40 or not t.is_alive(), 60, "the migrated decode to stream")
    second = routing_record(dep, out["id"])["decode_worker"]
    assert second != first and t.is_alive(), (second, len(out["chunks"]), out["error"])
    signal_pid(next(w["pid"] for w in dep.workers if w["worker_id"] == second), signal.SIGSTOP)
    t.join(90)
    assert not t.is_alive(), "the migrated stream hung"
    assert out["error"] is None and out["finish"] == "length", (out["error"], out["finish"])
    rec = routing_record(dep, out["id"])
    assert rec["decode_worker"] not in (first, second) and len(rec["decode_failures"]) == 2, rec
    whole = _post(dep, prompt, max_tokens=max_tokens).json()["choices"][0]  # uninterrupted, on the survivor
    assert whole["token_ids"] == _oracle(tiny_model_dir, prompt, max_tokens)
    assert "".join(out["chunks"]) == whole["text"]
    signal_pid(next(w["pid"] for w in dep.workers if w["worker_id"] == second), signal.SIGCONT)
    assert_no_leaks(dep)  # the stopped worker, resumed, frees the abandoned decode; the prefill side its stagings


@pytest.fixture
def dep_append_migrate(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=2,
              settings={**SETTINGS, "engine.time_dilation": 20.0, "router.routing_mode": "adaptive",
                        "router.decode_append_max_tokens": 64, "router.tpot_slo_s": 0.5},
              extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps(MIGRATION_TIMEOUTS)})
    yield d
    d.stop()


def test_a_decode_local_append_whose_worker_dies_mid_stream_is_migrated_and_ends_exact(dep_append_migrate,
                                                                                       tiny_model_dir):
    """Turn 2 of a conversation runs as a decode-local append on the decode worker holding turn 1
    (the prefill worker busy with a long prompt); that worker is SIGKILLed after 10 streamed tokens: the prompt and the tokens so far are
    re-prefilled and the stream goes on on the other decode worker, ending with the
    uninterrupted run's tokens."""
    dep = dep_append_migrate
    turn1 = random_prompt(3600, 200)
    r1 = _post(dep, turn1, max_tokens=8).json()
    holder = routing_record(dep, r1["id"])["decode_worker"]
    turn2, max_tokens = turn1 + r1["choices"][0]["token_ids"] + random_prompt(3601, 20), 120
    dep.wait_indexed(turn1 + r1["choices"][0]["token_ids"], "L1", worker_id=holder)  # its BlockStored events
    busy = threading.Thread(target=_post, args=(dep, random_prompt(3602, 12000), 1), daemon=True)
    busy.start()  # p0 queued: the append on the holder finishes first
    busy_worker(dep, "prefill")
    out: dict = {}
    t = threading.Thread(target=stream_completion, args=(dep, turn2, max_tokens, out), daemon=True)
    t.start()
    _wait_for(lambda: len(out.get("chunks", [])) >= 10, 30, "tokens to flow")
    rec = routing_record(dep, out["id"])
    assert (rec["reason"], rec["decode_worker"]) == ("decode-append", holder), json.dumps(rec)
    dep.kill_worker(holder)
    t.join(90)
    assert not t.is_alive(), "the migrated append hung"
    busy.join(60)
    assert out["error"] is None and out["finish"] == "length", (out["error"], out["finish"])
    rec = routing_record(dep, out["id"])
    assert rec["decode_worker"] != holder and len(rec["decode_failures"]) == 1, rec
    whole = _post(dep, turn2, max_tokens=max_tokens).json()["choices"][0]  # uninterrupted, on the survivor
    assert whole["token_ids"] == _oracle(tiny_model_dir, turn2, max_tokens)
    assert "".join(out["chunks"]) == whole["text"]
    assert_no_leaks(dep)
