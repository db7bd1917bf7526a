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
from deploy_util import assert_no_leaks, random_prompt, start

SHAPE, GPU = "llama-3.1-8b", "b200"
DILATION = 20.0  # a 512-token modeled prefill step lasts ~0.2 s, a decode step ~0.1 s
MAX_STEP_S = 2.0  # ten times a normal step here
LIVENESS_S, PROBE_INTERVAL_S, PROBE_TIMEOUT_S = 3.0, 0.5, 1.0
HANG_SEED, HANG_S = 4343, 600.0  # the hang outlasts the test: only the restart ends it
SLACK_S = 6.0  # a loaded 2-core machine
STUCK_KILL_BOUND_S = MAX_STEP_S + LIVENESS_S + PROBE_INTERVAL_S + PROBE_TIMEOUT_S + SLACK_S
STOP_KILL_BOUND_S = LIVENESS_S + PROBE_INTERVAL_S + 2 * PROBE_TIMEOUT_S + SLACK_S
READY_BOUND_S = 90.0  # a killed worker serves again within this (backoff + start, loaded machine)
SETTINGS = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
            "engine.time_dilation": DILATION, "engine.num_blocks": 4096, "engine.max_prefill_chunk_tokens": 512,
            "handoff.arena_bytes": 16 << 20, "engine.max_step_s": MAX_STEP_S,
            "deployment.liveness_timeout_s": LIVENESS_S, "deployment.liveness_probe_interval_s": PROBE_INTERVAL_S,
            "deployment.liveness_probe_timeout_s": PROBE_TIMEOUT_S, "deployment.liveness_startup_grace_s": 1.0}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, supervise=True, restart_backoff_s=0.5,
              settings=SETTINGS,
              extra_env={"CPD_FAULT_STEP_HANG_SEED": str(HANG_SEED), "CPD_FAULT_STEP_HANG_S": str(HANG_S)})
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


def _complete(dep, prompt: list[int], max_tokens: int) -> list[int]:
    client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.completions.create(model=dep.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    return resp.choices[0].token_ids


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
    results: dict[int, tuple[float, list[int] | str]] = {}

    def run(i):
        t0 = time.monotonic()
        try:
            tokens: list[int] | str = _complete(dep, prompts[i], 4)
        except openai.APIError as e:
            tokens = str(e)
        results[i] = (time.monotonic() - t0, tokens)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # in order: the long ones first
    for t in threads:
        t.join(180)
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
