"""Faults in a running deployment (real processes, real Redis): every request still
gets the oracle's tokens, nothing hangs, fallbacks are counted (docs/architecture.md).

Order matters inside this module: the last test stops Redis.

The deployment runs float32, the ordinary mode's exact dtype (docs/architecture.md, correctness
oracle): a request warm from L1 or L3 computes only its prompt's last tokens, in calls of other
shapes than the lone engine's prefill, and bf16 (``auto`` on CPUs with AVX512-BF16/AMX) may then
flip a greedy token.
"""
from __future__ import annotations

import re
import time

import httpx
import pytest
import redis

from deploy_util import assert_no_leaks, complete, oracle_tokens, random_prompt, routing_record, start

MAX_TOKENS = 8



@pytest.fixture(scope="module")
def dep(tiny_model_dir, store_proxy):
    d = start(tiny_model_dir, "cpd", kv_store=f"redis://127.0.0.1:{store_proxy.port}?timeout_s=0.5",
              settings={"engine.dtype": "float32"})
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _no_leaks(dep):
    yield
    assert_no_leaks(dep)




def _oracle(model_dir: str, prompt: list[int]) -> list[int]:
    return oracle_tokens(model_dir, prompt, MAX_TOKENS, dtype="float32")


def _fallbacks(dep) -> dict[str, float]:
    text = httpx.get(f"{dep.url}/metrics", timeout=5).text
    return {m[0]: float(m[1]) for m in re.findall(r'cpd_fallbacks_total\{kind="([^"]+)"\} ([0-9.e+]+)', text)}


def _warm_up_l3(dep, prompt) -> None:
    complete(dep, prompt, MAX_TOKENS)  # cold: pre-prefill writes the blocks through to L3
    time.sleep(0.5)
    dep.reset_prefix_caches()  # make sure a later hit can only come from L3


def test_corrupted_l3_payload_is_recomputed(dep, module_redis, tiny_model_dir):
    prompt = random_prompt(11, 160)
    _warm_up_l3(dep, prompt)
    r = redis.Redis(port=module_redis.port)
    keys = [k for k in r.keys("cpd:kv:*") if b"stage" not in k and b"meta" not in k]
    assert keys
    for k in keys:  # flip bytes in the middle of every stored payload
        v = bytearray(r.get(k))
        v[len(v) // 2] ^= 0xFF
        r.set(k, bytes(v))
    before = _fallbacks(dep).get("corrupt", 0)
    out = complete(dep, prompt, MAX_TOKENS)
    rec = routing_record(dep, out["id"])
    assert rec["load_plan"]["l3_blocks"] > 0  # the router believed L3 had it ...
    assert rec["cached_tokens_by_tier"].get("L3", 0) == 0  # ... the worker refused the corrupt blocks
    assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt)
    assert _fallbacks(dep).get("corrupt", 0) > before


def test_stale_index_block_gone_is_recomputed(dep, module_redis, tiny_model_dir):
    prompt = random_prompt(12, 160)
    _warm_up_l3(dep, prompt)
    redis.Redis(port=module_redis.port).flushall()  # blocks vanish without any BlockRemoved event
    out = complete(dep, prompt, MAX_TOKENS)
    assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt)
    assert _fallbacks(dep).get("stale_index", 0) >= 1
    again = complete(dep, prompt, MAX_TOKENS)  # index corrected: L3 no longer promised
    rec = routing_record(dep, again["id"])
    assert rec["load_plan"]["l3_blocks"] == 0 and rec["load_plan"]["l1_blocks"] > 0  # now from the L1 it computed
    assert again["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]


def test_slow_store_times_out_and_recomputes(dep, store_proxy, tiny_model_dir):
    prompt = random_prompt(16, 160)
    _warm_up_l3(dep, prompt)
    store_proxy.delay_s = 2.0  # every store round trip now takes longer than the 0.5 s timeout
    try:
        t0 = time.time()
        out = complete(dep, prompt, MAX_TOKENS)
        assert time.time() - t0 < 20
        assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt)
        assert routing_record(dep, out["id"])["cached_tokens_by_tier"].get("L3", 0) == 0
        assert _fallbacks(dep).get("timeout", 0) >= 1
    finally:
        store_proxy.delay_s = 0.0
        time.sleep(2.5)  # let delayed bytes drain


def test_store_unreachable_falls_back_fast(dep, module_redis, tiny_model_dir):
    prompt = random_prompt(13, 160)
    _warm_up_l3(dep, prompt)
    module_redis.stop()
    try:
        t0 = time.time()
        out = complete(dep, prompt, MAX_TOKENS)
        assert time.time() - t0 < 30
        assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt)
        fresh = random_prompt(14, 160)  # a cold prompt whose write-through fails
        assert complete(dep, fresh, MAX_TOKENS)["choices"][0]["token_ids"] == _oracle(tiny_model_dir, fresh)
        fb = _fallbacks(dep)
        assert fb.get("unavailable", 0) + fb.get("timeout", 0) > 0, fb
    finally:
        module_redis.start()


def test_prefill_worker_killed_request_retried_elsewhere(dep, tiny_model_dir):
    prompt = random_prompt(15, 160)
    complete(dep, prompt, MAX_TOKENS)
    time.sleep(0.5)
    warm = complete(dep, prompt, MAX_TOKENS)
    assert routing_record(dep, warm["id"])["prefill_worker"] == "p0"
    dep.kill_worker("p0")
    t0 = time.time()
    # Either the router's health poll notices first, or the request hits the dead worker and
    # is retried: both end on the pre-prefill worker with the right tokens.
    out = complete(dep, prompt, MAX_TOKENS)
    assert time.time() - t0 < 30
    assert routing_record(dep, out["id"])["prefill_worker"] == "pp0"
    assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt)
    assert _fallbacks(dep).get("worker_unhealthy", 0) >= 1
    health = httpx.get(f"{dep.url}/health", timeout=5).json()
    assert health["workers"]["p0"] is False
