"""The remaining fault matrix, live (issue 7 §10), on one supervised deployment (1 pre-prefill,
1 prefill, 2 decode; real Redis behind a delaying proxy; real SIGKILLs):

* a pre-prefill worker killed in the middle of its write-through: nothing partial becomes
  visible in L3, later requests load only sealed blocks (or recompute), same tokens;
* a decode worker killed mid-stream: a clear SSE error event to that client within a bound,
  a concurrent request on the other decode worker unaffected;
* the router killed and restarted: the workers keep running, the restarted router rebuilds
  its view (L1/L2 from worker snapshots, L3 from a store listing) and routes warm again.

Every test ends with every process serving again (the supervisor restarts what was killed)
and block pools and handoff stagings back to baseline. The Redis Cluster node case lives in
``test_redis_cluster.py`` (it needs the cluster fixture).

The deployment runs float32, the ordinary mode's exact dtype (docs/architecture.md, correctness
oracle): after the mid-write kill a request loads as much of the prefix as became visible (set by
the kill's timing) and computes the rest, warm requests compute only their prompt's last tokens,
in calls of other shapes than the lone engine's prefill; bf16 (``auto`` on CPUs with
AVX512-BF16/AMX) may then flip a greedy token.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import redis

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.store import open_store
from deploy_util import assert_no_leaks, complete, oracle_tokens, random_prompt, routing_record, start

MAX_TOKENS = 8
HANG_BOUND_S = 30.0  # no request of this module may take longer (loaded 2-core machine)
OTHER_TOKENS = 200  # the concurrent request on the surviving decode worker



@pytest.fixture(scope="module")
def dep(tiny_model_dir, store_proxy):
    # timeout_s 5: the slowed write-through below must be cut by the kill, not by a store timeout
    d = start(tiny_model_dir, "cpd", kv_store=f"redis://127.0.0.1:{store_proxy.port}?timeout_s=5", num_decode=2,
              supervise=True, restart_backoff_s=0.5, settings={"engine.dtype": "float32"})
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _serving_and_no_leaks(dep, store_proxy):
    yield
    store_proxy.delay_s = 0.0
    dep.wait_ready(120)
    assert_no_leaks(dep)


def _oracle(model_dir: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return oracle_tokens(model_dir, prompt, max_tokens, dtype="float32")


def _visible_chunk_keys(r: redis.Redis) -> list[bytes]:
    return [k for k in r.scan_iter("cpd:kv:*", count=1000) if b"stage" not in k and b"meta" not in k]


def _prompt_hashes(dep, prompt: list[int]) -> list[int]:
    return hash_blocks(prompt, Namespace(**dep.workers[0]["namespace"]))


def _timed_complete(dep, prompt, max_tokens=MAX_TOKENS) -> dict:
    t0 = time.monotonic()
    out = complete(dep, prompt, max_tokens)
    assert time.monotonic() - t0 < HANG_BOUND_S
    return out


def test_pre_prefill_killed_mid_write_through(dep, module_redis, store_proxy, tiny_model_dir):
    prompt = random_prompt(500, 1200)  # 75 blocks, about 600 KB of (float32) KV written through in 3 saves
    hashes = _prompt_hashes(dep, prompt)
    expected = _oracle(tiny_model_dir, prompt)
    r = redis.Redis(port=module_redis.port)
    assert not _visible_chunk_keys(r)
    store_proxy.delay_s = 0.25  # each 64 KB the writer sends now takes a quarter second
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=complete(dep, prompt, MAX_TOKENS)), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not _visible_chunk_keys(r):  # the first chunks landed: the writer is mid-way
        assert time.monotonic() < deadline, "write-through never started"
        time.sleep(0.01)
    dep.kill_worker("pp0")
    store_proxy.delay_s = 0.0
    t.join(HANG_BOUND_S)
    assert not t.is_alive(), "the request in flight hung"
    assert result["out"]["choices"][0]["token_ids"] == expected
    time.sleep(1.0)  # bytes the proxy still held have reached Redis (or were dropped with the connection)
    keys = _visible_chunk_keys(r)
    assert 0 < len(keys) < len(hashes), f"the kill did not land mid-write ({len(keys)} of {len(hashes)} visible)"
    print(f"pp0 killed mid-write: {len(keys)} of {len(hashes)} blocks visible")
    # nothing partial is visible: every visible chunk is complete and its checksum verifies
    store = open_store(module_redis.url)
    try:
        visible = [h for h in hashes if store.lookup_prefix([h]) == 1]  # chunk_blocks=1: one chunk per block
        assert len(visible) == len(keys)
        for h in visible:
            blocks, reason = store.read_blocks([h])
            assert blocks is not None, f"visible block {h:x} unreadable: {reason}"
        n_prefix = store.lookup_prefix(hashes)
    finally:
        store.close()
    # later requests load only sealed blocks (at most the visible prefix) or recompute: same tokens
    for _ in range(2):
        out = _timed_complete(dep, prompt)
        assert out["choices"][0]["token_ids"] == expected
        rec = routing_record(dep, out["id"])
        assert rec["cached_tokens_by_tier"].get("L3", 0) <= n_prefix * 16
    dep.wait_ready(120)  # pp0 back: a cold prompt takes the pre-prefill path again
    fresh = random_prompt(501, 300)
    out = _timed_complete(dep, fresh)
    assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, fresh)
    assert routing_record(dep, out["id"])["prefill_worker"] == "pp0"


def _stream(dep, prompt, max_tokens, events: list, first: threading.Event) -> None:
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=60) as resp:
        events.append(("status", resp.status_code, time.monotonic()))
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(("data", line[6:], time.monotonic()))
                first.set()
    events.append(("closed", None, time.monotonic()))
    first.set()


def test_decode_worker_killed_mid_stream(dep, tiny_model_dir):
    long_prompt, other_prompt = random_prompt(510, 40), random_prompt(511, 40)
    events: list = []
    first = threading.Event()
    t = threading.Thread(target=_stream, args=(dep, long_prompt, 1900, events, first), daemon=True)
    t.start()
    assert first.wait(HANG_BOUND_S)
    rid = json.loads(events[1][1])["id"]
    victim = routing_record(dep, rid)["decode_worker"]
    survivor = "d1" if victim == "d0" else "d0"
    other: dict = {}
    def run_other():
        other["out"] = complete(dep, other_prompt, OTHER_TOKENS)
        other["done_at"] = time.monotonic()
    t_other = threading.Thread(target=run_other, daemon=True)
    t_other.start()  # the victim is busy, so this one decodes on the survivor
    deadline = time.monotonic() + HANG_BOUND_S
    while sum(1 for e in events if e[0] == "data") < 20:  # mid-stream
        assert time.monotonic() < deadline and t.is_alive(), events[-3:]
        time.sleep(0.01)
    t_kill = time.monotonic()
    dep.kill_worker(victim)
    t.join(HANG_BOUND_S)
    assert not t.is_alive(), "the stream of the killed decode worker hung"
    datas = [json.loads(e[1]) for e in events if e[0] == "data" and e[1] != "[DONE]"]
    assert "error" in datas[-1], f"no error event at the end of the stream: {datas[-2:]}"
    err_at = next(e[2] for e in events if e[0] == "data" and "error" in e[1])
    assert err_at - t_kill < 10.0, err_at - t_kill
    print(f"error event {err_at - t_kill:.2f} s after the kill, after {len(events) - 4} text events")
    assert events[-2][1] == "[DONE]"
    assert not any(d["choices"][0].get("finish_reason") for d in datas[:-1] if d.get("choices"))
    # the other request, decoding on the other worker, is unaffected
    t_other.join(HANG_BOUND_S * 2)
    assert not t_other.is_alive()
    assert other["done_at"] > t_kill, "not concurrent: the other request ended before the kill"
    print(f"other request ended {other['done_at'] - t_kill:.2f} s after the kill")
    assert routing_record(dep, other["out"]["id"])["decode_worker"] == survivor
    assert other["out"]["choices"][0]["token_ids"] == _oracle(tiny_model_dir, other_prompt, OTHER_TOKENS)
    # the text the killed stream delivered was right as far as it went
    streamed = "".join(d["choices"][0]["text"] for d in datas[:-1] if d.get("choices"))
    dep.wait_ready(120)
    body = {"model": dep.model_name, "prompt": long_prompt, "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert streamed and (full.startswith(streamed) or streamed.startswith(full)), (streamed, full)


def test_router_killed_and_restarted_rebuilds_its_view(dep, tiny_model_dir):
    in_l3, in_l1 = random_prompt(520, 320), random_prompt(521, 320)
    _timed_complete(dep, in_l3)  # cold: pre-prefill writes it through to L3
    time.sleep(0.5)
    dep.reset_prefix_caches()  # now only L3 holds it
    _timed_complete(dep, in_l1)  # cold: in pp0's L1 (and in L3)
    time.sleep(0.5)
    before = httpx.get(f"{dep.url}/cpd/index", timeout=5).json()
    workers_before = {k: v for k, v in dep.pids().items() if k != "router"}
    dep.kill_router()
    t_kill = time.monotonic()
    for w in dep.workers:  # the workers keep running meanwhile
        assert httpx.get(f"{w['url']}/health", timeout=5).status_code == 200
    dep.wait_ready(120)
    print(f"router serving again {time.monotonic() - t_kill:.1f} s after SIGKILL")
    assert {k: v for k, v in dep.pids().items() if k != "router"} == workers_before
    assert dep.supervisor_status()["processes"]["router"]["restarts"] == 1
    after = httpx.get(f"{dep.url}/cpd/index", timeout=5).json()
    assert after["L1"] >= 320 // 16, (before, after)  # pp0's blocks, from its snapshot
    assert after["L3"] >= 2 * (320 // 16), (before, after)  # both prompts, from a store listing
    for prompt in (in_l3, in_l1):
        out = _timed_complete(dep, prompt)
        assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt)
        rec = routing_record(dep, out["id"])
        assert rec["class"] == "warm", rec
        plan, got = rec["load_plan"], rec["cached_tokens_by_tier"]
        assert got.get("L3", 0) == plan["l3_blocks"] * 16 and got.get("L1", 0) == plan["l1_blocks"] * 16, rec
    text = httpx.get(f"{dep.url}/metrics", timeout=5).text
    assert 'cpd_process_restarts_total{process="router",role="router"} 1.0' in text


def test_worker_restart_the_router_missed_is_resynced(dep, tiny_model_dir):
    """A worker that died and came back between two router polls (here: the router is frozen
    with SIGSTOP meanwhile) restarts its event sequence at 0 and has an empty cache. The router
    must notice the restart (a new ``boot_id``) and rebuild that worker's L1/L2 view — not keep
    its old blocks and ignore its new events as "old sequence numbers"."""
    prompts = [random_prompt(530 + i, 64) for i in range(6)]
    for p in prompts:  # cold on pp0, then warm on p0: p0 publishes a few event batches
        _timed_complete(dep, p)
    time.sleep(0.5)
    for p in prompts:
        assert routing_record(dep, _timed_complete(dep, p)["id"])["prefill_worker"] == "p0"
    router_pid = dep.pids()["router"]
    os.kill(router_pid, signal.SIGSTOP)
    try:
        dep.kill_worker("p0")
        deadline = time.monotonic() + 60
        while not (dep.children["p0"].restarts and dep.children["p0"].ready.is_set()):
            assert time.monotonic() < deadline, "p0 was not restarted"
            time.sleep(0.1)
    finally:
        os.kill(router_pid, signal.SIGCONT)
    time.sleep(2.0)  # a few polls
    old = _timed_complete(dep, prompts[0])  # its blocks died with the old p0: no L1 promised there
    rec = routing_record(dep, old["id"])
    assert old["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompts[0])
    assert rec["cached_tokens_by_tier"].get("L1", 0) == rec["load_plan"]["l1_blocks"] * 16, rec
    fresh = random_prompt(540, 64)
    _timed_complete(dep, fresh)  # cold: pp0
    time.sleep(0.5)
    _timed_complete(dep, fresh)  # warm: the new p0 loads it and announces it (its sequence restarted)
    time.sleep(0.5)
    out = _timed_complete(dep, fresh)
    rec = routing_record(dep, out["id"])
    assert rec["prefill_worker"] == "p0" and rec["load_plan"]["l1_blocks"] > 0, rec  # the router learned it
    assert rec["cached_tokens_by_tier"].get("L1", 0) == rec["load_plan"]["l1_blocks"] * 16, rec
    assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, fresh)
