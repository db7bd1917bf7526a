"""A router whose background work died or stalled (:mod:`cpd.router.background`) is detected and
repaired: real router, real modeled worker processes (``pd``: 1 prefill, 1 decode), real HTTP and ZMQ,
supervised by ``cpd serve``'s supervisor. The test-only fault file (``CPD_FAULT_ROUTER_TASK_FILE``,
naming the router's pid so that a restarted router is never hit) breaks one task of the running
router:

* the KV-event subscriber raises once: it is restarted in-process (the router keeps its pid, its
  ``/health`` stays 200 — the restart takes 0.5 s, the stall bound is ``STALL_S``), the exception
  is logged once with the task's name, the index is rebuilt from the workers' snapshots and fed
  by events again (a new prompt's blocks show up), and a prompt served before is routed warm with
  the same reuse ratio and gets the same greedy tokens;
* the KV-event subscriber hangs (a thread cannot be stopped from outside): ``/health`` turns 503
  ``background_stalled`` naming ``kv_events`` within ``STALL_S`` (+ slack), the supervisor kills and
  restarts the router (reason ``background_stalled``), the new router rebuilds its index to the old
  sizes and serves exact tokens;
* the worker poller raises at every iteration: restarted in-process 3 times, then given up;
  ``/health`` says 503 with "died after 3 restarts", and the supervisor restarts the router.
"""
from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from deploy_util import assert_no_leaks, random_prompt, routing_record, start

SHAPE, GPU = "llama-3.1-8b", "b200"
STALL_S = 4.0  # router.background_stall_timeout_s
LIVENESS_S, PROBE_INTERVAL_S, PROBE_TIMEOUT_S = 3.0, 0.5, 1.0
SLACK_S = 8.0  # a loaded 2-core machine
DETECT_BOUND_S = STALL_S + SLACK_S
# in-process restarts 0.5 + 1 + 2 s, then given up at the 4th death (RestartBound defaults)
GIVE_UP_BOUND_S = 0.5 + 1.0 + 2.0 + SLACK_S
KILL_AFTER_DETECT_BOUND_S = LIVENESS_S + PROBE_INTERVAL_S + 2 * PROBE_TIMEOUT_S + SLACK_S
READY_BOUND_S = 90.0
SETTINGS = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
            "engine.time_dilation": 20.0, "engine.num_blocks": 4096, "engine.max_prefill_chunk_tokens": 512,
            "handoff.arena_bytes": 16 << 20, "router.background_stall_timeout_s": STALL_S,
            "deployment.liveness_timeout_s": LIVENESS_S, "deployment.liveness_probe_interval_s": PROBE_INTERVAL_S,
            "deployment.liveness_probe_timeout_s": PROBE_TIMEOUT_S, "deployment.liveness_startup_grace_s": 1.0}


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    return tmp_path_factory.mktemp("router-fault") / "fault.json"


@pytest.fixture(scope="module")
def dep(tiny_model_dir, fault_file):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, supervise=True, restart_backoff_s=0.5,
              settings=SETTINGS, extra_env={"CPD_FAULT_ROUTER_TASK_FILE": str(fault_file)})
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _serving_before_and_no_leaks_after(dep, fault_file):
    dep.wait_ready(READY_BOUND_S)
    yield
    fault_file.unlink(missing_ok=True)
    dep.wait_ready(READY_BOUND_S)
    assert_no_leaks(dep)


def _oracle(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    eng = Engine(None, num_blocks=1024, executor=build_modeled_executor(SHAPE, GPU, 1, served_model_dir=model_dir))
    return eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _routed(dep, prompt: list[int]) -> tuple[list[int], dict]:
    """Greedy tokens of ``prompt`` through the router, and its routing record there."""
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=dep.model_name, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    return r.choices[0].token_ids, routing_record(dep, r.id)


def _health(dep) -> tuple[int, dict]:
    r = httpx.get(f"{dep.url}/health", timeout=5)
    return r.status_code, r.json()


def _warm_prompt(dep, tiny_model_dir, seed: int) -> tuple[list[int], list[int], dict, dict]:
    """A prompt served cold then warm (its blocks in the live index); the index sizes after."""
    prompt = random_prompt(seed, 300)
    cold_tokens, _ = _routed(dep, prompt)
    warm_tokens, warm = _routed(dep, prompt)
    assert cold_tokens == warm_tokens == _oracle(tiny_model_dir, prompt, 8)
    assert warm["reuse_ratio"] > 0, warm
    time.sleep(1.0)  # the last KV events reach the router
    sizes = dep.index_sizes()
    assert sizes["L1"] > 0, sizes
    return prompt, cold_tokens, warm, sizes


def _arm(fault_file, task: str, mode: str, pid: int) -> float:
    fault_file.write_text(json.dumps({"task": task, "mode": mode, "pid": pid}))
    return time.monotonic()


def _wait(cond, bound_s: float, what) -> float:
    """Seconds until ``cond()`` holds (AssertionError with ``what()`` after ``bound_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"not within {bound_s} s: {what()}")


def _wait_for_503(dep, accept, bound_s: float) -> tuple[float, dict]:
    """Seconds until the router's ``/health`` answers 503 with a body that ``accept(body)`` takes,
    and that body (AssertionError after ``bound_s``; a failed connection is a miss, not an error)."""
    seen: dict = {}

    def hit() -> bool:
        try:
            code, body = _health(dep)
        except httpx.HTTPError:
            return False
        if code == 503 and accept(body):
            seen.update(body)
            return True
        return False

    return _wait(hit, bound_s, lambda: _health(dep)), seen


def _metric(dep, name: str, **labels) -> float:
    text = httpx.get(f"{dep.url}/metrics", timeout=5).text
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
            return float(m.group(2))
    return 0.0


def _router_restarts(dep) -> int:
    return dep.supervisor_status()["processes"]["router"]["restarts"]


def _restarted_router_rebuilt_and_serves(dep, tiny_model_dir, old_pid, old_restarts, prompt, cold_tokens, warm,
                                         sizes, reason: str, seeds: range) -> None:
    """After the supervisor replaced the router: its rebuilt index has the old sizes, the warm prompt
    is routed as before with the same tokens, new prompts are exact, the restart is counted."""
    dep.wait_ready(READY_BOUND_S)
    assert dep.pids()["router"] != old_pid
    assert dep.index_sizes() == sizes, (dep.index_sizes(), sizes)
    after_tokens, after = _routed(dep, prompt)
    assert after_tokens == cold_tokens, (after_tokens, cold_tokens)
    assert after["reuse_ratio"] == warm["reuse_ratio"] and after["class"] == warm["class"], (after, warm)
    for seed in seeds:
        p = random_prompt(seed, 300)
        assert _routed(dep, p)[0] == _oracle(tiny_model_dir, p, 8)
    st = dep.supervisor_status()["processes"]["router"]
    assert st["restarts"] == old_restarts + 1 and st["last_restart_reason"] == f"liveness: {reason}", st
    assert st["liveness_restarts"].get(reason, 0) >= 1, st
    assert _metric(dep, "cpd_process_liveness_restarts_total", process="router", role="router", reason=reason) >= 1
    code, body = _health(dep)
    assert code == 200 and all(t["alive"] and t["restarts"] == 0 for t in body["background"].values()), body


def test_subscriber_that_dies_once_is_restarted_in_process_and_the_index_repopulates(dep, tiny_model_dir,
                                                                                     fault_file):
    prompt, cold_tokens, warm, sizes = _warm_prompt(dep, tiny_model_dir, 3100)
    pid, restarts = dep.pids()["router"], _router_restarts(dep)
    code, body = _health(dep)
    assert code == 200 and set(body["background"]) == {"kv_events", "worker_poller", "maintenance"}, body
    assert body["background"]["kv_events"]["restarts"] == 0
    _arm(fault_file, "kv_events", "raise_once", pid)
    codes: list[int] = []

    def restarted() -> bool:
        code, body = _health(dep)
        codes.append(code)
        kv = body["background"]["kv_events"]
        return kv["restarts"] == 1 and kv["state"] == "running" and kv["last_ok_age_s"] < 1.0

    took_s = _wait(restarted, DETECT_BOUND_S, lambda: _health(dep))
    print(f"kv_events died and was restarted in-process; ticking again {took_s:.2f} s after the fault was armed")
    assert not fault_file.exists()  # the fault fired (raise_once consumes the file)
    assert set(codes) == {200}, codes  # a 0.5 s restart is far inside the stall bound
    assert _health(dep)[1]["background"]["kv_events"]["last_error"].startswith("InjectedTaskFault")
    # the index is rebuilt from the workers' snapshots (events were lost meanwhile) ...
    _wait(lambda: dep.index_sizes() == sizes, 10.0, lambda: (dep.index_sizes(), sizes))
    # ... and fed by events again: a new prompt's blocks show up
    new_prompt = random_prompt(3101, 300)
    assert _routed(dep, new_prompt)[0] == _oracle(tiny_model_dir, new_prompt, 8)
    _wait(lambda: dep.index_sizes()["L1"] > sizes["L1"], 10.0, lambda: (dep.index_sizes(), sizes))
    after_tokens, after = _routed(dep, prompt)
    assert after_tokens == cold_tokens
    assert after["reuse_ratio"] == warm["reuse_ratio"] and after["class"] == warm["class"], (after, warm)
    assert dep.pids()["router"] == pid and _router_restarts(dep) == restarts  # no process restart
    assert _metric(dep, "cpd_router_background_task_restarts_total", task="kv_events") == 1.0
    assert _metric(dep, "cpd_router_background_task_up", task="kv_events") == 1.0
    died = [ln for ln in dep._log_path("router").read_text().splitlines()
            if "router background task kv_events died" in ln]
    assert len(died) == 1, died


def test_hung_subscriber_turns_health_503_and_the_supervisor_restarts_the_router(dep, tiny_model_dir, fault_file):
    prompt, cold_tokens, warm, sizes = _warm_prompt(dep, tiny_model_dir, 3200)
    pid, restarts = dep.pids()["router"], _router_restarts(dep)
    t0 = _arm(fault_file, "kv_events", "hang", pid)
    detect_s, seen = _wait_for_503(dep, lambda body: body.get("status") == "background_stalled", DETECT_BOUND_S)
    print(f"/health 503 background_stalled {detect_s:.2f} s after the hang (bound {DETECT_BOUND_S:g} s): "
          f"{seen['reason']}")
    assert detect_s >= STALL_S - 0.5  # not before the bound
    assert seen["background_stalled"] == ["kv_events"] and "kv_events made no progress" in seen["reason"], seen
    assert seen["background"]["kv_events"]["alive"] and seen["background"]["kv_events"]["last_ok_age_s"] > STALL_S
    assert seen["workers"] == {"p0": True, "d0": True}  # the workers are fine: only the router is not
    _wait(lambda: dep.pids()["router"] != pid, KILL_AFTER_DETECT_BOUND_S, dep.supervisor_status)
    print(f"router killed and respawned {time.monotonic() - t0:.2f} s after the hang")
    _restarted_router_rebuilt_and_serves(dep, tiny_model_dir, pid, restarts, prompt, cold_tokens, warm, sizes,
                                         "background_stalled", range(3210, 3212))
    print(f"router serving again {time.monotonic() - t0:.2f} s after the hang")


def test_poller_that_keeps_dying_is_given_up_and_the_router_restarted(dep, tiny_model_dir, fault_file):
    prompt, cold_tokens, warm, sizes = _warm_prompt(dep, tiny_model_dir, 3300)
    pid, restarts = dep.pids()["router"], _router_restarts(dep)
    t0 = _arm(fault_file, "worker_poller", "raise", pid)
    detect_s, seen = _wait_for_503(dep, lambda body: not body["background"]["worker_poller"]["alive"],
                                   GIVE_UP_BOUND_S)
    print(f"worker_poller given up {detect_s:.2f} s after the fault (bound {GIVE_UP_BOUND_S:g} s): {seen['reason']}")
    assert seen["status"] == "background_stalled" and seen["background_stalled"] == ["worker_poller"], seen
    assert "worker_poller died after 3 restarts" in seen["reason"] and "InjectedTaskFault" in seen["reason"]
    assert seen["background"]["worker_poller"]["restarts"] == 3
    _wait(lambda: dep.pids()["router"] != pid, KILL_AFTER_DETECT_BOUND_S, dep.supervisor_status)
    print(f"router killed and respawned {time.monotonic() - t0:.2f} s after the fault")
    _restarted_router_rebuilt_and_serves(dep, tiny_model_dir, pid, restarts, prompt, cold_tokens, warm, sizes,
                                         "background_stalled", range(3310, 3312))
