"""Issue 7 §2 live: one request never fails a batch or a worker (real processes, real HTTP).

- Every sampling value the API accepts is served: ``temperature: 1e-300`` (the reported
  example), the smallest double, tiny ``top_p``, extreme seeds — sent concurrently with greedy
  requests, which keep the oracle tokens; every worker stays healthy.
- A request that fails inside a worker's engine step (test-only fault hooks
  ``CPD_FAULT_*``, read by the real worker processes at start) gets an OpenAI error; the
  requests around it, in its batch too, get their oracle tokens; sent again and again it never
  takes its worker out. (An engine that fails, not a request: ``test_engine_failover.py``.)

The deployment runs float32: the greedy requests share steps with the others, and in the
ordinary mode only float32 keeps a request's tokens whatever ran beside it (docs/architecture.md,
correctness oracle; bf16, ``auto`` on CPUs with AVX512-BF16/AMX, flips a greedy token now and then).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cpd.engine.faults import SAMPLE_ERROR_ENV, STEP_ERROR_ENV
from deploy_util import assert_no_leaks, oracle_tokens, random_prompt, routing_record, start

MAX_TOKENS = 8
SAMPLE_FAULT_SEED = 666
STEP_FAULT_SEED = 777


def _post(dep, prompt: list[int], **sampling) -> httpx.Response:
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **sampling}
    return httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)


def _tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _worker_health(dep) -> dict[str, int]:
    return {w["worker_id"]: httpx.get(f"{w['url']}/health", timeout=5).status_code for w in dep.alive_workers()}


def _router_view(dep) -> dict[str, bool]:
    return {wid: w["healthy"] for wid, w in httpx.get(f"{dep.url}/cpd/workers", timeout=5).json().items()}


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "cpd", extra_env={SAMPLE_ERROR_ENV: SAMPLE_FAULT_SEED, STEP_ERROR_ENV: STEP_FAULT_SEED},
              settings={"engine.dtype": "float32"})
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    cache = {}

    def get(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = oracle_tokens(tiny_model_dir, prompt, MAX_TOKENS, dtype="float32")
        return cache[key]
    return get


@pytest.fixture(autouse=True)
def _no_leaks(dep):
    yield
    assert_no_leaks(dep)


EXTREMES = [
    {"temperature": 1e-300},
    {"temperature": 5e-324},
    {"temperature": 1e-300, "top_p": 5e-324, "seed": -(2 ** 63)},
    {"temperature": 2.0, "top_p": 1e-300},
    {"temperature": 2.0, "top_p": 1.0},
    {"temperature": 0.7, "seed": 2 ** 64 - 1},
    {"temperature": 1.0, "top_p": 0.999999, "seed": 0},
    {"temperature": 0.0, "seed": -1},
]


def _beside_greedy(dep, oracle, seed: int, num_greedy: int, extremes: list[dict]) -> tuple[list[int], list]:
    """``num_greedy`` greedy requests and one request per sampling setting of ``extremes`` (all on
    the first greedy prompt), sent at once; the greedy ones must keep their oracle tokens.
    Returns the shared prompt and the extreme requests' responses."""
    greedy = [random_prompt(seed + i, 40 + 9 * i) for i in range(num_greedy)]
    with ThreadPoolExecutor(len(greedy) + len(extremes)) as pool:
        g = [pool.submit(_post, dep, p) for p in greedy]
        x = [pool.submit(_post, dep, greedy[0], **s) for s in extremes]
        greedy_out = [f.result() for f in g]
        extreme_out = [f.result() for f in x]
    for p, r in zip(greedy, greedy_out):
        assert _tokens(r) == oracle(p)
    return greedy[0], extreme_out


def test_extreme_accepted_sampling_values_are_served_beside_greedy(dep, oracle):
    extreme_prompt, extreme_out = _beside_greedy(dep, oracle, 300, 4, EXTREMES)
    for s, r in zip(EXTREMES, extreme_out):
        toks = _tokens(r)  # 200 for every accepted value
        assert len(toks) == MAX_TOKENS, s
        if s["temperature"] < 1e-200:  # T → 0 is greedy (the maximum keeps all the mass)
            assert toks == oracle(extreme_prompt), s
    assert set(_worker_health(dep).values()) == {200}
    assert httpx.get(f"{dep.url}/health", timeout=5).status_code == 200


VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's, which the tiny model uses
ALL_STOP = {"stop_token_ids": list(range(VOCAB_SIZE)), "min_tokens": 3}  # every id is a stop id: the ban cannot hold
OPTION_EXTREMES = [
    {"temperature": 1.0, "seed": 5, **ALL_STOP},
    {"temperature": 1e-300, "seed": 6, **ALL_STOP},
    {"temperature": 0.0, **ALL_STOP},
    {"temperature": 2.0, "seed": 7, "repetition_penalty": 1e300, "presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"temperature": 2.0, "seed": 8, "repetition_penalty": 5e-324, "top_k": 2 ** 62, "min_p": 1.0},
    {"temperature": 0.5, "seed": 9, "top_k": 1, "min_p": 0.0, "min_tokens": MAX_TOKENS, "ignore_eos": False},
]


def test_extreme_sampling_options_are_served_beside_greedy(dep, oracle):
    """penalties, top_k, min_p, min_tokens at their accepted extremes: 200 for each (never a
    server error), the greedy neighbours keep their oracle tokens. Every id a stop id with
    min_tokens: the ban cannot hold, so the first min_tokens tokens are the model's own
    (greedy: the oracle's) and the next one, a stop id, ends the output."""
    extreme_prompt, extreme_out = _beside_greedy(dep, oracle, 310, 3, OPTION_EXTREMES)
    for s, r in zip(OPTION_EXTREMES, extreme_out):
        toks = _tokens(r)  # 200 for every accepted value
        if "stop_token_ids" in s:
            assert len(toks) == s["min_tokens"] + 1 and r.json()["choices"][0]["finish_reason"] == "stop", s
            if s["temperature"] < 1e-200:
                assert toks == oracle(extreme_prompt)[:len(toks)], s
        else:
            assert len(toks) == MAX_TOKENS, s
    assert set(_worker_health(dep).values()) == {200}


def _bad_beside_good(dep, oracle, prompts: list[list[int]], bad_prompt: list[int], bad_seed: int) -> None:
    """Send ``prompts`` and the bad request (sampled with ``bad_seed``) at once: the bad one gets an
    error, every other one the oracle's tokens."""
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        ok = [pool.submit(_post, dep, p) for p in prompts]
        bad = pool.submit(_post, dep, bad_prompt, temperature=0.5, seed=bad_seed)
        ok_out = [f.result() for f in ok]
        bad_out = bad.result()
    assert bad_out.status_code >= 500 and "error" in bad_out.json(), bad_out.text
    for p, r in zip(prompts, ok_out):
        assert _tokens(r) == oracle(p)


def test_request_failing_in_sampling_fails_alone(dep, oracle):
    _bad_beside_good(dep, oracle, [random_prompt(400 + i, 50 + 5 * i) for i in range(4)], random_prompt(499, 45),
                     SAMPLE_FAULT_SEED)
    assert set(_worker_health(dep).values()) == {200}
    assert all(_router_view(dep).values())


def _worker_health_bodies(dep) -> dict[str, dict]:
    return {w["worker_id"]: httpx.get(f"{w['url']}/health", timeout=5).json() for w in dep.alive_workers()}


def test_a_bad_request_in_a_batch_fails_alone_and_again_and_again_never_takes_a_worker_out(dep, oracle):
    # In a batch: the same cold prompt length on one pre-prefill worker, sent at once.
    _bad_beside_good(dep, oracle, [random_prompt(540 + i, 40) for i in range(4)], random_prompt(500, 40),
                     STEP_FAULT_SEED)
    before = _worker_health_bodies(dep)
    # Alone, again and again: each fails; no worker counts a failed step or leaves routing.
    for i in range(6):
        r = _post(dep, random_prompt(510 + i, 40), temperature=0.5, seed=STEP_FAULT_SEED)
        assert r.status_code >= 500 and "error" in r.json(), r.text
        assert set(_worker_health(dep).values()) == {200}
        assert all(_router_view(dep).values())
    after = _worker_health_bodies(dep)
    assert sum(h["num_failed_requests"] for h in after.values()) >= 6 + sum(
        h["num_failed_requests"] for h in before.values()), after
    assert all(h["num_failed_steps"] == 0 and h["consecutive_failed_steps"] == 0 for h in after.values()), after
    later = random_prompt(519, 40)
    assert _tokens(_post(dep, later)) == oracle(later)
