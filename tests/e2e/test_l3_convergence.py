"""The router's L3 view converges to what the store can serve (issue 7 §6), live.

One deployment (real worker and router processes, a real ``file://`` store with 4-block
chunks, supervised so a killed router comes back). For each trigger — a corrupt chunk in the
middle of a stored prefix, a router restart, chunk-granular storage — the check is the same:
with L1/L2 cleared (so L3 is the only cached tier), the routing record's predicted load plan
equals the tiers the worker actually loaded within a bounded number of requests, and stays so.
"""
from __future__ import annotations

import os
import time

import pytest

from cpd.kv.block_hash import Namespace, hash_blocks
from deploy_util import assert_no_leaks, complete, oracle_tokens, random_prompt, routing_record, start

BS = 16
CHUNK = 4
MAX_TOKENS = 4
MAX_REQUESTS_TO_CONVERGE = 2  # the request that meets the fault, then one more


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    # float32: a request warm from L3 computes only its prompt's last tokens, in calls of other shapes
    # than the lone engine's prefill; in the ordinary mode only float32 keeps the tokens then (bf16 may
    # flip one: docs/architecture.md, correctness oracle)
    d = start(tiny_model_dir, "cpd", l3_chunk_blocks=CHUNK, supervise=True, restart_backoff_s=0.2,
              settings={"engine.dtype": "float32"})
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _no_leaks(dep):
    yield
    assert_no_leaks(dep)


def _oracle(model_dir: str, prompt: list[int]) -> list[int]:
    return oracle_tokens(model_dir, prompt, MAX_TOKENS, dtype="float32")


def _wait(cond, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _clear_local_tiers(dep) -> None:
    """Empty every worker's L1/L2 and wait until the router's index has seen it."""
    dep.reset_prefix_caches()


def _store_l3_blocks(dep, prompt) -> None:
    """A cold request writes the prompt through to L3; wait until the router saw it announced."""
    before = dep.index_sizes()["L3"]
    complete(dep, prompt, MAX_TOKENS)
    _wait(lambda: dep.index_sizes()["L3"] >= before + len(prompt) // BS, timeout_s=60.0, what="L3 announcements")


def _plan_vs_actual(dep, prompt) -> tuple[dict, dict, list[int]]:
    _clear_local_tiers(dep)
    out = complete(dep, prompt, MAX_TOKENS)
    rec = routing_record(dep, out["id"])
    plan = rec["load_plan"]
    predicted = {"L1": plan["l1_blocks"] * BS, "L2": plan["l2_blocks"] * BS, "L3": plan["l3_blocks"] * BS}
    actual = {t: rec["cached_tokens_by_tier"].get(t, 0) for t in ("L1", "L2", "L3")}
    return predicted, actual, out["choices"][0]["token_ids"]


def _converges(dep, tiny_model_dir, prompt, expect_l3_tokens: int) -> int:
    """Requests until predicted == actual (at most MAX_REQUESTS_TO_CONVERGE), then once more to
    check it stays; every answer is the oracle's. Returns the requests it took."""
    want = _oracle(tiny_model_dir, prompt)
    history = []
    for i in range(1, MAX_REQUESTS_TO_CONVERGE + 1):
        predicted, actual, toks = _plan_vs_actual(dep, prompt)
        assert toks == want
        history.append((predicted, actual))
        if predicted == actual:
            predicted, actual, toks = _plan_vs_actual(dep, prompt)
            assert toks == want and predicted == actual, history + [(predicted, actual)]
            assert actual["L3"] == expect_l3_tokens, history + [(predicted, actual)]
            return i
    raise AssertionError(f"no convergence within {MAX_REQUESTS_TO_CONVERGE} requests: {history}")


def _hashes(dep, prompt) -> list[int]:
    return hash_blocks(prompt, Namespace(**dep.workers[0]["namespace"]))


def _chunk_path(dep, last_hash: int, n: int) -> str:
    return os.path.join(dep.kv_store.removeprefix("file://"), f"{last_hash:016x}.{n}.kv")


def test_corrupt_middle_chunk_keeps_valid_leading_blocks(dep, tiny_model_dir):
    prompt = random_prompt(701, 12 * BS + 8)  # 12 full blocks: chunks [0-3] [4-7] [8-11]
    _store_l3_blocks(dep, prompt)
    hs = _hashes(dep, prompt)
    path = _chunk_path(dep, hs[7], CHUNK)
    with open(path, "r+b") as f:  # flip a byte in the middle of the middle chunk's payload
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    predicted, actual, _ = _plan_vs_actual(dep, prompt)  # meets the corrupt chunk
    assert predicted["L3"] == 12 * BS and actual["L3"] == 0
    # only the corrupt chunk left the view: the valid leading chunk is still promised and served
    size = dep.index_sizes()["L3"]
    predicted, actual, toks = _plan_vs_actual(dep, prompt)
    assert toks == _oracle(tiny_model_dir, prompt)
    assert predicted == actual and actual["L3"] == 4 * BS
    # that request was cold (4 of 12 blocks cached): it rewrote the lost chunk, and the view
    # learns it, so the whole prefix is predicted and served again
    _wait(lambda: dep.index_sizes()["L3"] >= size + CHUNK, what="the rewritten chunk announced")
    assert _converges(dep, tiny_model_dir, prompt, expect_l3_tokens=12 * BS) == 1


def test_router_restart_rebuilds_l3_view(dep, tiny_model_dir):
    prompt = random_prompt(702, 12 * BS + 8)
    _store_l3_blocks(dep, prompt)
    old_pid = dep.kill_router()
    dep.wait_ready(120)
    assert dep.pids()["router"] != old_pid
    assert _converges(dep, tiny_model_dir, prompt, expect_l3_tokens=12 * BS) == 1  # listing at start


def test_chunked_store_index_agrees_at_chunk_granularity(dep, tiny_model_dir):
    a = random_prompt(703, 12 * BS + 8)  # chunks [0-3] [4-7] [8-11]
    _store_l3_blocks(dep, a)
    # b shares 6 blocks with a: the store can serve only the first whole chunk (4 blocks)
    b = a[:6 * BS] + random_prompt(704, 6 * BS + 8)
    predicted, actual, toks = _plan_vs_actual(dep, b)
    assert toks == _oracle(tiny_model_dir, b)
    assert predicted == actual and actual["L3"] == 4 * BS
    # that miss deleted nothing valid: a is still fully predicted and served
    assert _converges(dep, tiny_model_dir, a, expect_l3_tokens=12 * BS) == 1
    # a prompt of exactly 12 blocks computes its last token: at most 11 blocks load, and the
    # store serves whole chunks only, so 8
    exact = a[:12 * BS]
    assert _converges(dep, tiny_model_dir, exact, expect_l3_tokens=8 * BS) == 1
