"""A decode worker in the middle of a long engine step (an append's prefill chunk of the whole token
budget; a slow device) when a handed-off request arrives: the request's KV can be added only at the
step's end. The worker used to answer ``POST /decode`` only after that add, so the router's bound on
the response headers (``decode_floor_s``, 15 s by default: a guess of one step's length) ran out,
the healthy decode worker was marked unhealthy and excluded, and with no other one the request
failed with 503. Now the worker opens the stream once the KV is fetched and sends heartbeats with
its engine's progress until the add: the wait is bounded by progress (the worker's own
``engine_stuck`` verdict, the router's ``decode_stall_s``), as a prefill is.

Real router, worker processes and HTTP (tiny torch model, ``pd`` 1 + 1). The long step is the one
fake: ``CPD_FAULT_STEP_HANG_SEED`` in the decode worker only blocks the step of a seeded append
for ``HANG_S``, far below ``engine.max_step_s`` (not stuck), and the router's header bound is
shortened to ``connect_s + decode_floor_s`` = 3 s so that the step outlasts it.
"""
from __future__ import annotations

import json
import threading
import time

import httpx

from cpd.messages.sampling import SamplingParams as WireSampling
from cpd.messages.worker_api import AppendRequest, encode
from deploy_util import assert_no_leaks, oracle_tokens, random_prompt, router_workers, start

HANG_SEED, HANG_S = 4343, 8.0
TIMEOUTS = {"connect_s": 1.0, "decode_floor_s": 2.0}


def test_a_handoff_arriving_during_a_long_decode_worker_step_waits_for_it_and_keeps_the_worker(tiny_model_dir):
    dep = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1,
                extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps(TIMEOUTS), "CPD_FAULT_WORKER": "d0",
                           "CPD_FAULT_STEP_HANG_SEED": str(HANG_SEED), "CPD_FAULT_STEP_HANG_S": str(HANG_S)})
    try:
        d0 = next(w["url"] for w in dep.workers if w["worker_id"] == "d0")
        long_step = AppendRequest(request_id="long-step", prompt_token_ids=random_prompt(7, 64),
                                  sampling=WireSampling(max_tokens=1, seed=HANG_SEED))  # one step: HANG_S long
        hog = threading.Thread(target=httpx.post, args=(f"{d0}/append",), daemon=True,
                               kwargs={"content": encode(long_step), "headers": {"content-type": "application/json"},
                                       "timeout": HANG_S * 3, "auth": dep.internal_client_auth()})
        hog.start()
        time.sleep(0.5)  # d0's step has begun
        prompt = random_prompt(8, 40)
        t0 = time.monotonic()
        r = httpx.post(f"{dep.url}/v1/completions", timeout=HANG_S * 4,
                       json={"model": dep.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True})
        waited_s = time.monotonic() - t0
        assert r.status_code == 200, r.text  # before: 503, d0 excluded after 3 s
        assert r.json()["choices"][0]["token_ids"] == oracle_tokens(tiny_model_dir, prompt, 6)
        assert waited_s > TIMEOUTS["connect_s"] + TIMEOUTS["decode_floor_s"]  # it did wait past the header bound
        rec = httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[r.json()["id"]]
        assert rec["decode_worker"] == "d0" and "decode_failures" not in rec, rec
        assert router_workers(dep)["d0"]["healthy"]
        hog.join(HANG_S * 3)
        assert_no_leaks(dep)
    finally:
        dep.stop()
