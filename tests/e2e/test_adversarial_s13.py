"""Adversarial session 13 (helper-63): inputs and faults the other e2e files do not use, against
real deployments (router + worker processes of the tiny random-weight Llama, real HTTP).

- Worker registration with client API keys on and no internal secret (a ``cpd router
  --api-key-file`` started without ``$CPD_INTERNAL_SECRET``): ``POST /cpd/register`` bypasses the
  API-key middleware (it is "self-authenticated" by the internal secret) and, with no secret,
  authenticated nothing: one unauthenticated POST moved the decode worker ``d0`` to an address of
  the caller's choosing, so every tenant's next request failed with 503 (or, with a fake worker
  behind that address, would have been sent to the caller). ``POST /cpd/role`` already refused
  this configuration with 403 ``internal_secret_required``; registration now does the same.
- Clients that hang up while the router waits for the prefill worker's answer (120 hang-ups at
  random moments 0.02-0.6 s after sending, around the tiny model's prefill time; plain and
  streaming): a few of them left their KV staged on the prefill worker (``num_staged`` > 0 long
  after every request ended; 4-16 per run; freed only by the sender's reclaim, 120 s later). The
  worker had staged and written its answer line; the router's task was cancelled while awaiting
  it, so nobody released the staging. The router now releases the attempt's staging by its
  request id when its prefill call is abandoned (cancelled, failed in transport or time).
- Router call bounds no request can meet (``router.timeouts``): ``max_prefill_attempts=0`` was
  accepted and every request got 503 "prefill failed on : None"; idle bounds of 0.01 s (below the
  workers' 0.5 s line interval), zero or negative bounds were accepted and marked healthy workers
  unhealthy on the first request. They are now refused when the configuration is read.
- A prefill worker stopped (SIGSTOP; a hung or partitioned host) while its staged KV waits for
  the decode worker's TCP fetch (``handoff.force_tcp``, the cross-host path): the decode worker's
  fetch waits up to twice its 10 s receiver timeout, longer than the router's 15 s bound on the
  decode's first byte, so the router blames the healthy *decode* worker (marked unhealthy,
  excluded) instead of re-prefilling on the healthy prefill worker. With one decode worker the
  request fails with 503 and unrelated requests meanwhile get 503 "no healthy decode worker".
  Fixed: the router sends its bound on the fetch (``DecodeRequest.fetch_timeout_s``, half the
  first-byte bound), the receiver holds the whole fetch to it (not each socket call), the decode
  worker answers 502 ``handoff_unavailable`` in time, and the router re-prefills with that sender
  excluded for the request.

Findings and what held: /work/notes/adversarial13.md.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deploy_util import oracle_tokens, random_prompt, start, wait_pools_idle

ALICE = "sk-alice-s13-0123456789"


@pytest.fixture(scope="module")
def keys_no_secret_dep(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("s13keys") / "keys"
    keys.write_text(f"{ALICE} alice\n")
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, api_key_files=[str(keys)])
    yield d
    d.stop()


def _workers(dep) -> dict:
    r = httpx.get(f"{dep.url}/cpd/workers", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def test_unauthenticated_registration_cannot_move_a_worker_when_api_keys_are_on(keys_no_secret_dep):
    dep = keys_no_secret_dep
    before = _workers(dep)
    assert before["d0"]["state"] == "accepted", before
    # no Authorization header, no signature: a stranger on the network
    r = httpx.post(f"{dep.url}/cpd/register", json={"worker_id": "d0", "role": "decode", "url": "http://127.0.0.1:9",
                                                     "events_endpoint": "tcp://127.0.0.1:9"}, timeout=30)
    assert r.status_code in (401, 403), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "internal_secret_required", err
    after = _workers(dep)
    assert after["d0"]["url"] == before["d0"]["url"] and after["d0"]["state"] == "accepted", after
    prompt = random_prompt(13, 24)
    out = httpx.post(f"{dep.url}/v1/completions", headers={"Authorization": f"Bearer {ALICE}"}, timeout=60,
                     json={"model": dep.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == oracle_tokens(dep.model_dir, prompt, 4)


# ---- clients gone while the router awaits the prefill answer ------------------------------------
@pytest.fixture(scope="module")
def pd_dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1)
    yield d
    d.stop()


def _num_staged(dep) -> dict[str, int]:
    auth = dep.internal_client_auth()
    return {w["worker_id"]: (httpx.get(f"{w['url']}/load", timeout=5, auth=auth).json().get("handoff") or {})
            .get("num_staged", 0) for w in dep.alive_workers()}


def test_clients_gone_while_the_prefill_answer_is_on_its_way_leave_no_staging(pd_dep, tiny_model_dir):
    dep = pd_dep
    rng = random.Random(13)

    async def hang_up(client, i: int, stream: bool) -> str:
        body = {"model": dep.model_name, "prompt": random_prompt(9000 + i, rng.randint(50, 250)), "max_tokens": 50,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        try:  # the whole exchange bounded: the client goes away at a random moment around the prefill's end
            await asyncio.wait_for(client.post(f"{dep.url}/v1/completions", json=body), timeout=rng.uniform(0.02, 0.6))
            return "finished"
        except asyncio.TimeoutError:
            return "hung up"

    async def rounds() -> list[str]:
        out: list[str] = []
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            for r in range(3):
                out += await asyncio.gather(*[hang_up(client, 100 * r + i, i % 2 == 1) for i in range(40)])
        return out

    outcomes = asyncio.run(rounds())
    assert outcomes.count("hung up") >= 60, outcomes  # the clients did go away mid-request
    stats = wait_pools_idle(dep, 20.0)
    assert all(s["num_in_use"] == 0 for s in stats.values()), stats
    deadline = time.monotonic() + 10.0  # releases are fire-and-forget: give them a moment
    staged = _num_staged(dep)
    while any(staged.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        staged = _num_staged(dep)
    assert not any(staged.values()), f"stagings left behind by clients that hung up: {staged}"
    prompt = random_prompt(14, 40)  # and the deployment serves exact tokens afterwards
    out = httpx.post(f"{dep.url}/v1/completions", timeout=60,
                     json={"model": dep.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True})
    assert out.status_code == 200 and out.json()["choices"][0]["token_ids"] == oracle_tokens(tiny_model_dir, prompt, 6)


# ---- call bounds no request can meet ------------------------------------------------------------
@pytest.mark.parametrize("setting, field", [("max_prefill_attempts=0", "max_prefill_attempts"),
                                            ("max_decode_attempts=0", "max_decode_attempts"),
                                            ("max_decode_migrations=-1", "max_decode_migrations"),
                                            ("prefill_idle_s=0.01", "prefill_idle_s"),
                                            ("decode_idle_s=0.5", "decode_idle_s"),
                                            ("connect_s=0", "connect_s"), ("decode_stall_s=-1", "decode_stall_s"),
                                            ("prefill_slack=-1", "prefill_slack")])
def test_router_call_bounds_no_request_can_meet_are_refused_up_front(setting, field):
    cpd = Path(sys.executable).with_name("cpd")
    r = subprocess.run([str(cpd), "config", "show", "--set", f"router.timeouts.{setting}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0, r.stdout[-500:]
    assert "invalid configuration" in r.stderr and f"timeouts.{field}" in r.stderr, r.stderr[-500:]
    ok = subprocess.run([str(cpd), "config", "show", "--set", "router.timeouts.max_decode_migrations=2"],
                        capture_output=True, text=True, timeout=120)  # a meetable bound is still taken
    assert ok.returncode == 0 and "max_decode_migrations = 2" in ok.stdout, ok.stderr[-500:]


# ---- a prefill worker stopped while its staging waits for the TCP fetch ------------------------
@pytest.fixture(scope="module")
def tcp_dep(tiny_model_dir):
    # float32: the victim is re-prefilled and decoded while the hog and the bystanders run, and in the
    # ordinary mode only float32 keeps its tokens whatever ran beside it (docs/architecture.md, oracle)
    d = start(tiny_model_dir, "pd", num_prefill=2, num_decode=1, handoff_force_tcp=True, max_decode_per_worker=1,
              settings={"engine.dtype": "float32"})
    yield d
    d.stop()


def test_a_stopped_sender_during_the_tcp_fetch_fails_neither_its_request_nor_others(tcp_dep, tiny_model_dir):
    dep = tcp_dep
    url, auth = dep.url, dep.internal_client_auth()
    body = {"model": dep.model_name, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    # the only decode slot (max_decode_per_worker=1) is held by a long streamed decode until the test lets it
    # go (hang-up: the router aborts it): the victim's staging waits for the slot however fast the hog decodes
    hog_decoding, release_hog = threading.Event(), threading.Event()

    def hog_stream() -> None:
        hog_body = dict(body, prompt=random_prompt(10, 20), max_tokens=1900, stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=hog_body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    hog_decoding.set()
                if release_hog.is_set() or line == "data: [DONE]":
                    return

    hog = threading.Thread(target=hog_stream)
    hog.start()
    assert hog_decoding.wait(60), "the hog's decode never started"
    prompt = random_prompt(99, 100)
    result: dict = {}

    def victim() -> None:
        r = httpx.post(f"{url}/v1/completions", json=dict(body, prompt=prompt, max_tokens=8), timeout=180)
        result["victim"] = r

    vt = threading.Thread(target=victim)
    vt.start()
    stopped = None
    deadline = time.monotonic() + 20
    try:
        while stopped is None and time.monotonic() < deadline:  # its prefill answered: stop the worker holding it
            for w in dep.alive_workers():
                h = httpx.get(f"{w['url']}/load", timeout=5, auth=auth).json().get("handoff") or {}
                if w["role"] == "prefill" and h.get("num_staged"):
                    stopped = w["worker_id"]
                    os.kill(dep.pids()[stopped], signal.SIGSTOP)
                    break
            time.sleep(0.02)
        assert stopped is not None, "the victim's staging never appeared"
        assert hog.is_alive(), "the hog finished before the victim's staging was stopped: the test proved nothing"
        threading.Timer(2.0, release_hog.set).start()  # the slot frees while the bystanders run
        bystanders = []
        while vt.is_alive():  # unrelated requests while the victim's decode waits: none may fail
            r = httpx.post(f"{url}/v1/completions", json=dict(body, prompt=random_prompt(300 + len(bystanders), 30),
                                                               max_tokens=4), timeout=120)
            bystanders.append((r.status_code, r.text[:200]))
            time.sleep(1.0)
        hog.join(120)
    finally:
        release_hog.set()
        if stopped is not None:
            os.kill(dep.pids()[stopped], signal.SIGCONT)
    r = result["victim"]
    assert r.status_code == 200, r.text  # p1 is healthy: a re-prefill there serves it
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens(tiny_model_dir, prompt, 8, dtype="float32")
    assert all(code == 200 for code, _ in bystanders), bystanders
