"""``--batch-invariant`` live, in bfloat16 (where the ordinary kernels' results depend on the chunks
and the batch: ``tests/integration/test_batch_invariance.py``): real worker processes of the small
model, adaptive routing with the decode-local append on, a small step budget so that concurrent
prompts share steps and are chunked differently from the oracle's lone run. Every answer must be
the greedy tokens of one batch-invariant engine running the prompt alone:

- a storm of concurrent cold prompts of different lengths, then their warm follow-ups (prefix from
  L1 / L2, KV handed off to the decode worker);
- a decode-local append (turn 2 prefilled on the decode worker over KV it computed one decode step
  at a time: the path the ordinary mode keeps exact only in float32).
"""
from __future__ import annotations

import pytest

from deploy_util import (assert_no_leaks, complete, oracle_tokens, random_prompt, routing_record,
                         staggered_requests, start)

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def inv_dep(tiny_model_dir):
    dep = start(tiny_model_dir, "cpd", num_prefill=1, max_num_batched_tokens=96,
                settings={"engine.dtype": "bfloat16", "engine.batch_invariant": True,
                          "router.routing_mode": "adaptive", "router.tpot_slo_s": 0.5,
                          "router.decode_append_max_tokens": 64})
    yield dep
    dep.stop()


@pytest.fixture(autouse=True)
def _no_leaks(inv_dep):
    yield
    assert_no_leaks(inv_dep)


def _oracle(dep, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return oracle_tokens(dep.model_dir, prompt, max_tokens, dtype="bfloat16", batch_invariant=True)


def _storm(dep, prompts: dict[str, list[int]]) -> dict[str, list[int] | str]:
    """Every prompt at once; ``{key: tokens or the error's text}``."""
    keys = list(prompts)
    done = staggered_requests(lambda p: complete(dep, p, MAX_TOKENS)["choices"][0]["token_ids"],
                              [prompts[k] for k in keys], stagger_s=0.0, join_s=300.0)
    return {keys[i]: tokens for i, (_, tokens) in done.items()}


def test_concurrent_cold_and_warm_requests_get_the_lone_oracle_tokens(inv_dep):
    cold = {f"c{i}": random_prompt(600 + i, 300 + 83 * i) for i in range(6)}
    got = _storm(inv_dep, cold)
    warm = {f"w{i}": cold[f"c{i}"] + random_prompt(700 + i, 9 + 5 * i) for i in range(6)}
    got.update(_storm(inv_dep, warm))
    wrong = {k: v if isinstance(v, str) else next((j for j, (a, b) in enumerate(zip(v, _oracle(inv_dep, p))) if a != b),
                                                  len(v))
             for k, p in {**cold, **warm}.items() if (v := got.get(k)) != _oracle(inv_dep, p)}
    assert not wrong, f"answers off the oracle (first differing index or error): {wrong}"


def test_decode_local_append_in_bf16_returns_oracle_tokens(inv_dep):
    turn1 = random_prompt(31, 90)
    r1 = complete(inv_dep, turn1, 12)
    decode_worker = routing_record(inv_dep, r1["id"])["decode_worker"]
    inv_dep.wait_indexed(turn1 + r1["choices"][0]["token_ids"], "L1", worker_id=decode_worker)
    turn2 = turn1 + r1["choices"][0]["token_ids"] + random_prompt(32, 8)
    r2 = complete(inv_dep, turn2, 8)
    rec = routing_record(inv_dep, r2["id"])
    assert (rec["reason"], rec["prefill_worker"]) == ("decode-append", decode_worker), rec
    assert r1["choices"][0]["token_ids"] == _oracle(inv_dep, turn1, 12)
    assert r2["choices"][0]["token_ids"] == _oracle(inv_dep, turn2, 8)
