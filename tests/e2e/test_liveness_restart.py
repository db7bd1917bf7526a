"""Liveness watchdog (:mod:`cpd.liveness`, :mod:`cpd.supervise`): a worker whose engine is stuck, or
whose process no longer answers, is killed and restarted by the deployment's supervisor, as a
Kubernetes liveness probe restarts a pod (real router, real modeled worker processes, real HTTP;
``pd``: 1 prefill, 1 decode, so every request after a restart goes through the restarted worker).

* stuck engine (the test-only fault ``CPD_FAULT_STEP_HANG_SEED``, a hang far longer than the test):
  the worker calls itself stuck after ``MAX_STEP_S``, fails its probes for ``LIVENESS_S`` more, is
  SIGKILLed within ``STUCK_KILL_BOUND_S`` of the hang and serves exact tokens after its restart;
* a SIGSTOPped worker (answers nothing) is killed within ``STOP_KILL_BOUND_S`` and serves again;
* no false positive: a worker busy for several times ``MAX_STEP_S + LIVENESS_S`` with long queued
  prefills (every step short, so it answers 200) is never restarted, and every request is exact.

* one bad request (``CPD_FAULT_STEP_ERROR_SEED``: every forward that holds it fails), sent again and
  again, fails alone each time and never gets its worker restarted: the engine's canary forward runs,
  so it is no failed step (the count stays 0);
* a worker whose engine breaks for good (``CPD_FAULT_BREAK_SEED``: every forward from the trigger on
  fails, the canary's too) says 503 and, idle, probes its engine every ``RETRY_AFTER_S``; each failed
  probe counts, so it is restarted once it reports ``MAX_FAILED_STEPS`` consecutive failures (reason
  ``consecutive_failed_steps``, before the ``LIVENESS_S`` timeout of its 503s), within
  ``FAILED_STEPS_KILL_BOUND_S`` of the break while clients keep sending, and serves exact tokens after;
* a SIGSTOPped router is killed within ``STOP_KILL_BOUND_S`` and restarted on its port; the new
  router rebuilds its view at start-up (workers from its config, L1/L2 from each worker's
  ``/kv_snapshot``, L3 from a store listing): its prefix index holds what the old one held, a prompt
  served before the fault is routed warm with the same reuse ratio and gets the same tokens.

Each test ends with every block pool back to empty (the restarted worker's is new; the others' must
have freed everything) and the restart counted with its reason in ``/cpd/processes`` and
``/metrics``. The order matters: the no-false-positive test runs first, on a deployment without
restarts.
"""
from __future__ import annotations

import re
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest

from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.messages.sampling import SamplingParams as WireSampling
from cpd.messages.worker_api import PrefillRequest, encode
from deploy_util import assert_no_leaks, random_prompt, routing_record, staggered_requests, start, wait_all_healthy

SHAPE, GPU = "llama-3.1-8b", "b200"
DILATION = 20.0  # a 512-token modeled prefill step lasts ~0.2 s, a decode step ~0.1 s
MAX_STEP_S = 2.0  # ten times a normal step here
LIVENESS_S, PROBE_INTERVAL_S, PROBE_TIMEOUT_S = 3.0, 0.5, 1.0
HANG_SEED, HANG_S = 4343, 600.0  # the hang outlasts the test: only the restart ends it
STEP_ERROR_SEED, BREAK_SEED = 4545, 4646  # one failed step; an engine broken for good
MAX_FAILED_STEPS = 3  # deployment.liveness_max_failed_steps
# an idle worker whose engine failed probes it this often (engine.failed_steps_retry_after_s): short
# enough that MAX_FAILED_STEPS failed probes come before LIVENESS_S of 503 answers, so that the
# failed-steps limit restarts it (with the default 5 s the timeout rule would restart it first)
RETRY_AFTER_S = 0.5
ROUTER_POLL_S = 0.5  # the router polls each worker's /load this often (WorkerSet's default)
SLACK_S = 6.0  # a loaded 2-core machine
STUCK_KILL_BOUND_S = MAX_STEP_S + LIVENESS_S + PROBE_INTERVAL_S + PROBE_TIMEOUT_S + SLACK_S
STOP_KILL_BOUND_S = LIVENESS_S + PROBE_INTERVAL_S + 2 * PROBE_TIMEOUT_S + SLACK_S
# the break's own failure, then MAX_FAILED_STEPS - 1 probes RETRY_AFTER_S apart, then the supervisor's probe
FAILED_STEPS_KILL_BOUND_S = MAX_FAILED_STEPS * RETRY_AFTER_S + PROBE_INTERVAL_S + PROBE_TIMEOUT_S + SLACK_S
READY_BOUND_S = 90.0  # a killed worker serves again within this (backoff + start, loaded machine)
SETTINGS = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
            "engine.time_dilation": DILATION, "engine.num_blocks": 4096, "engine.max_prefill_chunk_tokens": 512,
            "handoff.arena_bytes": 16 << 20, "engine.max_step_s": MAX_STEP_S,
            "deployment.liveness_timeout_s": LIVENESS_S, "deployment.liveness_probe_interval_s": PROBE_INTERVAL_S,
            "deployment.liveness_probe_timeout_s": PROBE_TIMEOUT_S, "deployment.liveness_startup_grace_s": 1.0,
            "deployment.liveness_max_failed_steps": MAX_FAILED_STEPS,
            "engine.failed_steps_retry_after_s": RETRY_AFTER_S}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, supervise=True, restart_backoff_s=0.5,
              settings=SETTINGS,
              extra_env={"CPD_FAULT_STEP_HANG_SEED": str(HANG_SEED), "CPD_FAULT_STEP_HANG_S": str(HANG_S),
                         "CPD_FAULT_STEP_ERROR_SEED": str(STEP_ERROR_SEED), "CPD_FAULT_BREAK_SEED": str(BREAK_SEED)})
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _serving_before_and_no_leaks_after(dep):
    dep.wait_ready(READY_BOUND_S)
    yield
    dep.wait_ready(READY_BOUND_S)
    assert_no_leaks(dep)


def _oracle(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    eng = Engine(None, num_blocks=1024, executor=build_modeled_executor(SHAPE, GPU, 1, served_model_dir=model_dir))
    return eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _create(dep, prompt: list[int], max_tokens: int, timeout_s: float = 120, **sampling):
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    return client.completions.create(model=dep.model_name, prompt=prompt, max_tokens=max_tokens,
                                     **{"temperature": 0, **sampling},
                                     extra_body={"ignore_eos": True, "return_token_ids": True})


def _complete(dep, prompt: list[int], max_tokens: int) -> list[int]:
    return _create(dep, prompt, max_tokens).choices[0].token_ids


def _serves_exact(dep, tiny_model_dir, seeds: range) -> None:
    for seed in seeds:
        prompt = random_prompt(seed, 300)
        assert _complete(dep, prompt, 8) == _oracle(tiny_model_dir, prompt, 8)


def _url(dep, worker_id: str) -> str:
    return next(w["url"] for w in dep.workers if w["worker_id"] == worker_id)


def _hang(dep, worker_id: str) -> None:
    """The seeded prefill straight to ``worker_id``: its step hangs for ``HANG_S``. The sender
    gives up after a few seconds (the worker streams progress lines meanwhile)."""
    rid = f"hang-{uuid.uuid4().hex[:8]}"
    body = PrefillRequest(request_id=rid, prompt_token_ids=random_prompt(999, 64), stream_progress=True,
                          sampling=WireSampling(max_tokens=4, seed=HANG_SEED))

    def post():
        give_up = time.monotonic() + 5.0
        try:
            with httpx.stream("POST", f"{_url(dep, worker_id)}/prefill", content=encode(body), headers=JSON,
                              timeout=5.0, auth=dep.internal_client_auth()) as r:
                for _ in r.iter_lines():
                    if time.monotonic() > give_up:
                        return
        except httpx.HTTPError:
            pass
    threading.Thread(target=post, daemon=True).start()


def _wait_killed(dep, worker_id: str, old_pid: int, bound_s: float) -> float:
    """Seconds until the supervisor has replaced ``worker_id``'s process (AssertionError after ``bound_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        if dep.pids()[worker_id] != old_pid:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{worker_id} not restarted within {bound_s} s: {dep.supervisor_status()}")


def _liveness_metric(dep, worker_id: str, reason: str) -> float:
    """``cpd_process_liveness_restarts_total`` for one process and reason, from the router's /metrics
    (labels in any order)."""
    text = httpx.get(f"{dep.url}/metrics", timeout=5).text
    for m in re.finditer(r"^cpd_process_liveness_restarts_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("process") == worker_id and labels.get("reason") == reason:
            return float(m.group(2))
    return 0.0


def _restarts(dep) -> dict[str, int]:
    return {name: p["restarts"] for name, p in dep.supervisor_status()["processes"].items()}


def test_busy_worker_is_not_restarted(dep, tiny_model_dir):
    """Long queued prefills (5 x 6144 tokens, ~60 steps) keep p0 busy for several times
    ``MAX_STEP_S + LIVENESS_S``; every step
    is short, so /health answers 200 throughout: nothing is restarted, every request is exact."""
    pids, restarts = dep.pids(), _restarts(dep)
    prompts = [random_prompt(2040 + i, 6144 if i < 5 else 100) for i in range(8)]
    results = staggered_requests(lambda p: _complete(dep, p, 4), prompts, join_s=180)
    assert len(results) == len(prompts), results
    print({i: round(s, 2) for i, (s, _) in sorted(results.items())})
    for i, (_, tokens) in results.items():
        assert tokens == _oracle(tiny_model_dir, prompts[i], 4), (i, tokens)
    assert max(s for s, _ in results.values()) > 2 * (MAX_STEP_S + LIVENESS_S), results  # the case under test
    assert dep.pids() == pids and _restarts(dep) == restarts, dep.supervisor_status()
    assert all(not p["liveness_restarts"] for p in dep.supervisor_status()["processes"].values())


def test_stuck_engine_is_restarted_and_serves_exact_tokens_again(dep, tiny_model_dir):
    old_pid, restarts = dep.pids()["p0"], _restarts(dep)
    t_hang = time.monotonic()
    _hang(dep, "p0")
    killed_s = _wait_killed(dep, "p0", old_pid, STUCK_KILL_BOUND_S)
    print(f"p0 killed and respawned {killed_s:.2f} s after its step hung (bound {STUCK_KILL_BOUND_S:g} s)")
    assert killed_s >= MAX_STEP_S + LIVENESS_S - 0.5  # not before it was stuck and failing for the timeout
    dep.wait_ready(READY_BOUND_S)
    print(f"p0 serving again {time.monotonic() - t_hang:.2f} s after the hang")
    _serves_exact(dep, tiny_model_dir, range(2100, 2103))  # pd 1+1: through the restarted p0
    st = dep.supervisor_status()["processes"]
    assert st["p0"]["restarts"] == restarts["p0"] + 1 and st["p0"]["last_restart_reason"] == "liveness: engine_stuck"
    assert st["p0"]["liveness_restarts"].get("engine_stuck") == 1, st["p0"]
    assert {k: v for k, v in _restarts(dep).items() if k != "p0"} == {k: v for k, v in restarts.items() if k != "p0"}
    assert _liveness_metric(dep, "p0", "engine_stuck") == 1.0


def test_stopped_worker_is_restarted_and_serves_again(dep, tiny_model_dir):
    old_pid, restarts = dep.pids()["d0"], _restarts(dep)
    dep.children["d0"].proc.send_signal(signal.SIGSTOP)
    killed_s = _wait_killed(dep, "d0", old_pid, STOP_KILL_BOUND_S)
    print(f"d0 killed and respawned {killed_s:.2f} s after SIGSTOP (bound {STOP_KILL_BOUND_S:g} s)")
    assert killed_s >= LIVENESS_S - 0.5
    dep.wait_ready(READY_BOUND_S)
    _serves_exact(dep, tiny_model_dir, range(2200, 2203))  # through the restarted d0
    st = dep.supervisor_status()["processes"]
    assert st["d0"]["restarts"] == restarts["d0"] + 1 and st["d0"]["last_restart_reason"] == "liveness: no_answer"
    assert _liveness_metric(dep, "d0", "no_answer") == 1.0


def _worker_health(dep, worker_id: str) -> dict:
    return httpx.get(f"{_url(dep, worker_id)}/health", timeout=5).json()


def _seeded_request_fails(dep, seed: int, prompt_seed: int) -> None:
    """A client request with a fault seed (sampled, so that the seed is the request's): it fails."""
    with pytest.raises(openai.APIError):
        _create(dep, random_prompt(prompt_seed, 64), 4, timeout_s=30, temperature=0.5, seed=seed)


def test_one_bad_request_fails_alone_and_never_restarts_its_worker(dep, tiny_model_dir):
    """The same bad request, alone, 2 × ``MAX_FAILED_STEPS`` times in a row (the old rule restarted
    the worker after ``MAX_FAILED_STEPS``): each fails, p0 stays healthy, nothing is restarted."""
    pids, restarts = dep.pids(), _restarts(dep)
    before = _worker_health(dep, "p0")
    for i in range(2 * MAX_FAILED_STEPS):
        _seeded_request_fails(dep, STEP_ERROR_SEED, 2300)
        h = _worker_health(dep, "p0")
        assert h["status"] == "ok" and h["consecutive_failed_steps"] == 0, h
    assert h["num_failed_requests"] >= before["num_failed_requests"] + 2 * MAX_FAILED_STEPS, h  # it fired, on p0
    assert h["num_failed_steps"] == before["num_failed_steps"], h
    time.sleep(4 * PROBE_INTERVAL_S + PROBE_TIMEOUT_S)  # the supervisor's probes see it
    wait_all_healthy(dep, SLACK_S)
    _serves_exact(dep, tiny_model_dir, range(2310, 2312))
    assert dep.pids() == pids and _restarts(dep) == restarts, dep.supervisor_status()
    assert not dep.supervisor_status()["processes"]["p0"]["liveness_restarts"].get("consecutive_failed_steps")


def test_worker_whose_steps_keep_failing_is_restarted_and_serves_exact_tokens(dep, tiny_model_dir):
    """Clients keep sending while p0's engine is broken: p0 says 503 from the first failed step on
    (the router has no prefill worker left: clients get errors), probes its idle engine every
    ``RETRY_AFTER_S``, and the supervisor restarts it once ``MAX_FAILED_STEPS`` failures are reported."""
    old_pid, restarts = dep.pids()["p0"], _restarts(dep)
    t_break = time.monotonic()
    _seeded_request_fails(dep, BREAK_SEED, 2400)
    outcomes: list[str] = []
    while dep.pids()["p0"] == old_pid and time.monotonic() - t_break < FAILED_STEPS_KILL_BOUND_S:
        try:
            _create(dep, random_prompt(2410 + len(outcomes), 64), 4, timeout_s=10)
            outcomes.append("ok")
        except openai.APIError as e:
            outcomes.append(f"{getattr(e, 'status_code', '')}")
        time.sleep(0.2)
    killed_s = time.monotonic() - t_break
    print(f"p0 restarted {killed_s:.2f} s after its engine broke (bound {FAILED_STEPS_KILL_BOUND_S:g} s); "
          f"client answers meanwhile: {outcomes}")
    assert dep.pids()["p0"] != old_pid, (outcomes, dep.supervisor_status())
    assert "ok" not in outcomes  # pd 1+1: nothing served while the only prefill worker was broken
    dep.wait_ready(READY_BOUND_S)
    _serves_exact(dep, tiny_model_dir, range(2450, 2453))  # through the restarted p0
    st = dep.supervisor_status()["processes"]
    assert st["p0"]["restarts"] == restarts["p0"] + 1, st["p0"]
    assert st["p0"]["last_restart_reason"] == "liveness: consecutive_failed_steps", st["p0"]
    assert st["p0"]["liveness_restarts"].get("consecutive_failed_steps") == 1, st["p0"]
    assert {k: v for k, v in _restarts(dep).items() if k != "p0"} == {k: v for k, v in restarts.items() if k != "p0"}
    assert _liveness_metric(dep, "p0", "consecutive_failed_steps") == 1.0


def _routed(dep, prompt: list[int]) -> tuple[list[int], dict]:
    """Greedy tokens of ``prompt`` through the router, and its routing record there."""
    r = _create(dep, prompt, 8)
    return r.choices[0].token_ids, routing_record(dep, r.id)


def test_stopped_router_is_restarted_and_rebuilds_its_view(dep, tiny_model_dir):
    prompt = random_prompt(2500, 300)
    cold_tokens, _ = _routed(dep, prompt)  # served before the fault ...
    warm_tokens, warm = _routed(dep, prompt)  # ... and warm: the live index knows its blocks
    assert cold_tokens == warm_tokens == _oracle(tiny_model_dir, prompt, 8)
    assert warm["reuse_ratio"] > 0, warm
    time.sleep(1.0)  # the last KV events reach the router
    sizes = dep.index_sizes()
    assert sizes["L1"] > 0, sizes
    old_pid, restarts = dep.pids()["router"], _restarts(dep)
    dep.children["router"].proc.send_signal(signal.SIGSTOP)
    killed_s = _wait_killed(dep, "router", old_pid, STOP_KILL_BOUND_S)
    print(f"router killed and respawned {killed_s:.2f} s after SIGSTOP (bound {STOP_KILL_BOUND_S:g} s)")
    assert killed_s >= LIVENESS_S - 0.5
    dep.wait_ready(READY_BOUND_S)
    # the new router's view, rebuilt from the workers' snapshots and the store (it saw no event)
    assert dep.index_sizes() == sizes, (dep.index_sizes(), sizes)
    after_tokens, after = _routed(dep, prompt)
    assert after_tokens == cold_tokens, (after_tokens, cold_tokens)
    assert after["reuse_ratio"] == warm["reuse_ratio"] and after["class"] == warm["class"], (after, warm)
    _serves_exact(dep, tiny_model_dir, range(2510, 2512))
    st = dep.supervisor_status()["processes"]
    assert st["router"]["restarts"] == restarts["router"] + 1, st["router"]
    assert st["router"]["last_restart_reason"] == "liveness: no_answer", st["router"]
    assert {k: v for k, v in _restarts(dep).items() if k != "router"} == {
        k: v for k, v in restarts.items() if k != "router"}
    assert _liveness_metric(dep, "router", "no_answer") == 1.0
