"""A worker whose engine is stuck (a step that never returns: a hung kernel, a deadlock) while its
event loop lives must never hang a request (real router, real modeled worker processes, real HTTP,
the official ``openai`` client; ``pd``: 2 prefill, 2 decode).

The stuck step is the one fake: ``CPD_FAULT_STEP_HANG_SEED`` (:mod:`cpd.engine.faults`) blocks the
step of any worker that schedules a request with that seed, for ``HANG_S`` (then the worker
recovers, so that the next test starts from a healthy deployment). The test sends that seeded
request straight to the chosen worker's internal API, beside the client's request already running
there. Before the fix the worker kept sending empty heartbeats, so the router waited the whole
hang (unbounded for a step that never returns) and kept routing new requests to the stuck worker.

Bounds under test: the worker calls itself stuck once its step has run ``MAX_STEP_S``
(``engine.max_step_s``), its next heartbeat (0.5 s) or progress line says so, and the router fails
the attempt over (a prefill, or a decode before its first decoded token: another worker) or ends
the request with a clear error (a decode after decoded tokens, as for a dead decode worker: a
resume would recompute the generated tokens' KV in one chunk, not token by token, and need not
give the same next tokens). ``BOUND_S`` = ``MAX_STEP_S`` + 6 s of slack for a loaded 2-core machine, far
under ``HANG_S``. The router's own progress bounds (``prefill_stall_s``, ``decode_stall_s``) stay
long here: the worker's verdict is what must end these requests.
"""
from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import openai
import pytest

from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.messages.sampling import SamplingParams as WireSampling
from cpd.messages.worker_api import (AppendRequest, DecodeLine, DecodeRequest, PrefillRequest,
                                     PrefillResponse, decode_body, encode)
from deploy_util import (assert_no_leaks, busy_worker, random_prompt, router_workers, staggered_requests, start,
                         wait_all_healthy, wait_pools_idle)

SHAPE, GPU = "llama-3.1-8b", "b200"
DILATION = 20.0  # a 512-token modeled prefill step lasts ~0.2 s, a decode step ~0.1 s
MAX_STEP_S = 2.0  # ten times a normal step here
HANG_SEED, HANG_S = 4242, 16.0
BOUND_S = MAX_STEP_S + 6.0
MODELED = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
           "engine.time_dilation": DILATION, "engine.num_blocks": 1024, "engine.max_prefill_chunk_tokens": 512,
           # room in a step for the seeded request beside a 512-token chunk of the client's prompt, so
           # that the hang lands mid-prefill (with 512, it waited until the prefill had ended)
           "engine.max_num_batched_tokens": 1024,
           "handoff.arena_bytes": 16 << 20, "engine.max_step_s": MAX_STEP_S}
TIMEOUTS = {"connect_s": 2.0, "prefill_idle_s": 5.0, "prefill_stall_s": 60.0, "decode_idle_s": 5.0}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=2, num_decode=2, settings=MODELED,
              extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps(TIMEOUTS), "CPD_FAULT_STEP_HANG_SEED": str(HANG_SEED),
                         "CPD_FAULT_STEP_HANG_S": str(HANG_S)})
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _healthy_before_and_no_leaks_after(dep):
    wait_all_healthy(dep)
    yield
    wait_all_healthy(dep, timeout_s=HANG_S + 10)  # the stuck worker recovers when its hang ends
    assert_no_leaks(dep)


def _oracle(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    eng = Engine(None, num_blocks=1024, executor=build_modeled_executor(SHAPE, GPU, 1, served_model_dir=model_dir))
    return eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _client(dep) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=HANG_S * 4)


def _url(dep, worker_id: str) -> str:
    return next(w["url"] for w in dep.workers if w["worker_id"] == worker_id)


def _hang(dep, worker_id: str) -> threading.Thread:
    """Send the seeded request straight to ``worker_id`` (an append on a decode worker, a prefill
    otherwise): its next step hangs. The sender gives up after half the hang, so the worker aborts
    it and recovers when the hang ends."""
    role = next(w["role"] for w in dep.workers if w["worker_id"] == worker_id)
    rid, prompt = f"hang-{uuid.uuid4().hex[:8]}", random_prompt(999, 64)
    sampling = WireSampling(max_tokens=4, seed=HANG_SEED)
    path, body = (("/append", AppendRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling))
                  if role == "decode" else
                  ("/prefill", PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                              stream_progress=True)))

    def post():  # the worker streams progress lines meanwhile: the sender hangs up by the clock
        give_up_s = time.monotonic() + HANG_S / 2
        try:
            with httpx.stream("POST", f"{_url(dep, worker_id)}{path}", content=encode(body), headers=JSON,
                              timeout=HANG_S / 2, auth=dep.internal_client_auth()) as r:
                for _ in r.iter_lines():
                    if time.monotonic() > give_up_s:
                        return
        except httpx.HTTPError:
            pass
    t = threading.Thread(target=post, daemon=True)
    t.start()
    return t


def _wait_router_sees_unhealthy(dep, worker_id: str, timeout_s: float = BOUND_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not router_workers(dep)[worker_id]["healthy"]:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"router still routes to stuck {worker_id}: {router_workers(dep)[worker_id]}")


def _complete_exact(dep, tiny_model_dir, prompt: list[int], max_tokens: int):
    """One completion through the router, its tokens checked against the oracle."""
    resp = _client(dep).completions.create(model=dep.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    assert resp.choices[0].token_ids == _oracle(tiny_model_dir, prompt, max_tokens)
    return resp


def _routed_away(dep, tiny_model_dir, stuck: str, seeds: range) -> None:
    """New requests while ``stuck`` is stuck: each succeeds with its exact tokens, within the bound,
    on the other workers."""
    for seed in seeds:
        t0 = time.monotonic()
        resp = _complete_exact(dep, tiny_model_dir, random_prompt(seed, 300), 4)
        assert time.monotonic() - t0 < BOUND_S
        rec = httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[resp.id]
        assert stuck not in (rec["prefill_worker"], rec["decode_worker"]), rec


def _others_idle(dep, stuck: str) -> None:
    """The block pools of every worker but the stuck one are back to empty."""
    stats = wait_pools_idle(dep)
    busy = {w: s["num_in_use"] for w, s in stats.items() if w != stuck and s["num_in_use"]}
    assert not busy, busy


def test_decode_worker_stuck_mid_stream_ends_the_stream_with_a_clear_error(dep, tiny_model_dir):
    prompt, max_tokens = random_prompt(1001, 200), 60
    client = _client(dep)
    args = dict(model=dep.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    full = _complete_exact(dep, tiny_model_dir, prompt, max_tokens)  # the whole text
    text, n_chunks, t_hang = "", 0, None
    with pytest.raises(openai.APIError) as err:
        for chunk in client.completions.create(stream=True, **args):
            text += chunk.choices[0].text if chunk.choices else ""
            n_chunks += 1
            if t_hang is None and n_chunks >= 3:
                stuck = busy_worker(dep, "decode")
                t_hang, hanger = time.monotonic(), _hang(dep, stuck)
    elapsed = time.monotonic() - t_hang
    print(f"stream ended {elapsed:.2f} s after the hang, {n_chunks} chunks: {err.value}")
    assert "stuck" in str(err.value), err.value
    assert elapsed < BOUND_S, elapsed
    assert full.choices[0].text.startswith(text)  # never a wrong token
    _wait_router_sees_unhealthy(dep, stuck)
    _routed_away(dep, tiny_model_dir, stuck, range(1010, 1013))
    _others_idle(dep, stuck)
    hanger.join(HANG_S)


def test_decode_worker_stuck_non_streaming_answers_within_the_bound(dep, tiny_model_dir):
    prompt, max_tokens = random_prompt(1002, 200), 60
    out: dict = {}

    def run():
        try:
            out["resp"] = _client(dep).completions.create(model=dep.model_name, prompt=prompt, max_tokens=max_tokens,
                                                          temperature=0,
                                                          extra_body={"ignore_eos": True, "return_token_ids": True})
        except openai.APIError as e:
            out["error"] = e
        out["t_end"] = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    stuck = busy_worker(dep, "decode")
    time.sleep(0.5)  # decoding now
    t_hang, hanger = time.monotonic(), _hang(dep, stuck)
    t.join(HANG_S * 3)
    elapsed = out["t_end"] - t_hang
    print(f"answer {elapsed:.2f} s after the hang: {out.get('error') or 'complete'}")
    assert elapsed < BOUND_S, elapsed
    if "resp" in out:  # the hang came before its first decoded token: retried on the other worker
        assert out["resp"].choices[0].token_ids == _oracle(tiny_model_dir, prompt, max_tokens)
    else:
        assert out["error"].status_code == 502 and "stuck" in str(out["error"]), out["error"]
    _wait_router_sees_unhealthy(dep, stuck)
    _routed_away(dep, tiny_model_dir, stuck, range(1020, 1023))
    _others_idle(dep, stuck)
    hanger.join(HANG_S)


def test_prefill_worker_stuck_mid_prefill_fails_over_with_the_exact_tokens(dep, tiny_model_dir):
    prompt, max_tokens = random_prompt(1003, 6144), 4  # 12 prefill steps
    want = _oracle(tiny_model_dir, prompt, max_tokens)
    out: dict = {}

    def run():
        out["resp"] = _client(dep).completions.create(model=dep.model_name, prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0,
                                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        out["t_end"] = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    stuck = busy_worker(dep, "prefill")
    t_hang, hanger = time.monotonic(), _hang(dep, stuck)
    t.join(HANG_S * 3)
    elapsed = out["t_end"] - t_hang
    print(f"answer {elapsed:.2f} s after the hang")
    assert out["resp"].choices[0].token_ids == want
    rec = httpx.get(f"{dep.url}/cpd/requests", timeout=5).json()[out["resp"].id]
    assert rec["prefill_worker"] != stuck, rec
    assert elapsed < BOUND_S + 3.0, elapsed  # plus the whole prefill again on the other worker
    _wait_router_sees_unhealthy(dep, stuck)
    _routed_away(dep, tiny_model_dir, stuck, range(1030, 1033))
    _others_idle(dep, stuck)
    hanger.join(HANG_S)


def test_requests_queued_behind_long_prefills_are_not_failed(dep, tiny_model_dir):
    """No false positive: each worker's queue holds requests for several times ``MAX_STEP_S``
    (long prefills ahead of them), every step stays short, so nothing is stuck: all succeed
    with their exact tokens and every worker stays healthy."""
    prompts = [random_prompt(1040 + i, 6144 if i < 4 else 100) for i in range(8)]

    def send(prompt: list[int]) -> list[int]:
        r = _client(dep).completions.create(model=dep.model_name, prompt=prompt, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
        return r.choices[0].token_ids
    results = staggered_requests(send, prompts, join_s=120)
    assert len(results) == len(prompts), results
    unhealthy = {w: v for w, v in router_workers(dep).items() if not v["healthy"]}
    print({i: round(s, 2) for i, (s, _) in sorted(results.items())})
    for i, (_, tokens) in results.items():
        assert tokens == _oracle(tiny_model_dir, prompts[i], 4), (i, tokens)
    assert max(s for s, _ in results.values()) > 2 * MAX_STEP_S, results  # the case under test: long waits
    assert not unhealthy, unhealthy


def test_a_decode_arriving_at_a_stuck_worker_is_refused_and_its_staging_decodes_elsewhere(dep, tiny_model_dir):
    """A ``/decode`` that reaches a worker whose step is stuck waited for the engine lock to add its
    KV, with no answer (not even headers) until the step ended: the router's only bound was the
    first-byte bound (``decode_floor_s``, 15 s by default), not the engine's progress. Now the
    worker opens the stream at once, sends heartbeats while the KV waits, and once it calls itself
    stuck says so on a heartbeat line and ends the stream without a token; it leaves the staging
    for another decode worker and does not keep the request when the step ends (the teardown's
    leak check). (It answered 503 ``engine_stuck`` before the stream opened early: see
    ``test_decode_admission_long_step.py``.)"""
    auth, prompt, max_tokens = dep.internal_client_auth(), random_prompt(1050, 100), 8
    sampling = WireSampling(max_tokens=max_tokens, ignore_eos=True)
    r = httpx.post(f"{_url(dep, 'p0')}/prefill", content=encode(PrefillRequest(
        request_id="direct-1050", prompt_token_ids=prompt, sampling=sampling)), headers=JSON, timeout=30, auth=auth)
    ans = decode_body(r.content, PrefillResponse)
    hanger = _hang(dep, "d0")
    time.sleep(0.5)  # d0's step is stuck now, not yet for MAX_STEP_S
    decode = DecodeRequest(request_id="direct-1050", token_ids=prompt + list(ans.first_token_ids), sampling=sampling,
                           handoff=ans.handoff)
    t0 = time.monotonic()
    with httpx.stream("POST", f"{_url(dep, 'd0')}/decode", content=encode(decode), headers=JSON, timeout=HANG_S * 2,
                      auth=auth) as r:
        lines = [decode_body(line.encode(), DecodeLine) for line in r.iter_lines() if line]
    elapsed = time.monotonic() - t0
    print(f"d0 ended its stream {elapsed:.2f} s after the decode was sent: {lines[-1] if lines else None}")
    assert r.status_code == 200 and lines and lines[-1].engine_stuck, lines
    assert all(line.is_heartbeat for line in lines), lines  # not a token from the stuck worker
    assert elapsed < BOUND_S, elapsed
    tokens = list(ans.first_token_ids)
    with httpx.stream("POST", f"{_url(dep, 'd1')}/decode", content=encode(decode), headers=JSON, timeout=30,
                      auth=auth) as r:
        for line in r.iter_lines():
            msg = decode_body(line.encode(), DecodeLine) if line else None
            if msg is not None and not msg.is_heartbeat:
                tokens += msg.token_ids
                if msg.finish_reason is not None:
                    break
    assert tokens == _oracle(tiny_model_dir, prompt, max_tokens)
    hanger.join(HANG_S)
