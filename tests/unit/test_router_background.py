"""The router's background tasks (:mod:`cpd.router.background`): the pure health verdict, the
restart bound, the supervisor's reading of a stalled router, and the restart mechanism on real
threads, a real event loop and a real fault file."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import pytest

from cpd.liveness import BACKGROUND_STALLED, LivenessPolicy, LivenessState, classify_answer
from cpd.router.background import (DEAD, RESTARTING, RUNNING, BackgroundTasks, InjectedTaskFault, RestartBound,
                                   TaskState, background_verdict, stall_bound_s)


# --- the pure verdict ----------------------------------------------------------------------------
def _t(name="kv_events", state=RUNNING, started=0.0, last_ok=None, bound=10.0, restarts=0, err=None):
    return TaskState(name, state, started, last_ok, bound, restarts, err)


def test_no_tasks_and_fresh_tasks_are_healthy():
    assert background_verdict([], 1e6).healthy
    v = background_verdict([_t(last_ok=95.0), _t("worker_poller", last_ok=99.9)], 100.0)
    assert v.healthy and v.reason == "" and v.failing == ()


def test_silence_counts_from_the_last_tick_and_the_bound_is_exclusive():
    assert background_verdict([_t(last_ok=90.0)], 100.0).healthy  # exactly the bound: still fine
    v = background_verdict([_t(last_ok=90.0)], 100.5)
    assert not v.healthy and v.failing == ("kv_events",)
    assert "kv_events made no progress for 10.5 s (bound 10 s)" in v.reason


def test_a_task_that_never_ticked_is_silent_since_its_start():
    assert background_verdict([_t(started=50.0)], 59.0).healthy
    assert background_verdict([_t(started=50.0)], 61.0).failing == ("kv_events",)


def test_a_dead_task_fails_at_once_with_its_error():
    v = background_verdict([_t(state=DEAD, last_ok=99.9, restarts=3, err="RuntimeError('x')"),
                            _t("maintenance", last_ok=99.9)], 100.0)
    assert v.failing == ("kv_events",)
    assert v.reason == "background task kv_events died after 3 restarts: RuntimeError('x')"


def test_a_restarting_task_is_fine_within_its_bound_and_a_stall_past_it():
    assert background_verdict([_t(state=RESTARTING, last_ok=95.0, err="E()")], 100.0).healthy
    v = background_verdict([_t(state=RESTARTING, last_ok=80.0, err="E()")], 100.0)
    assert v.failing == ("kv_events",) and "(last error: E())" in v.reason


def test_every_failing_task_is_named_in_order():
    v = background_verdict([_t("worker_poller", last_ok=0.0), _t("kv_events", state=DEAD, err="E()"),
                            _t("maintenance", last_ok=99.0)], 100.0)
    assert v.failing == ("kv_events", "worker_poller")
    assert v.reason.index("kv_events") < v.reason.index("worker_poller")


def test_stall_bound_is_never_under_three_periods():
    assert stall_bound_s(60.0, 0.05) == 60.0
    assert stall_bound_s(60.0, 30.0) == 90.0


def test_restart_bound_backs_off_gives_up_and_forgets_after_a_stable_run():
    b = RestartBound(initial_backoff_s=0.5, max_backoff_s=1.5, max_restarts=3, stable_after_s=60.0)
    assert [b.delay_s(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 1.5, None]
    assert b.next_deaths(2, ran_s=1.0) == 3
    assert b.next_deaths(3, ran_s=60.0) == 1


# --- the supervisor's reading of the router's /health -------------------------------------------
def test_supervisor_restarts_a_stalled_router_but_never_a_degraded_one():
    assert classify_answer(503, {"status": "degraded"}, 1.0).healthy
    r = classify_answer(503, {"status": BACKGROUND_STALLED, BACKGROUND_STALLED: ["kv_events"]}, 1.0)
    assert (r.healthy, r.reason) == (False, BACKGROUND_STALLED)
    assert classify_answer(200, {"status": "ok", "background": {}}, 1.0).healthy
    st = LivenessState(LivenessPolicy(timeout_s=10.0, probe_interval_s=1.0, startup_grace_s=0.0))
    st.on_ready(0.0)
    stalled = {"status": BACKGROUND_STALLED, BACKGROUND_STALLED: ["kv_events"]}
    verdicts = [st.observe(classify_answer(503, stalled, 1.0 + i)) for i in range(12)]
    assert verdicts[:10] == [None] * 10 and verdicts[10] == BACKGROUND_STALLED


# --- the mechanism --------------------------------------------------------------------------------
FAST = RestartBound(initial_backoff_s=0.01, max_backoff_s=0.05, max_restarts=2, stable_after_s=60.0)


def test_a_thread_task_that_raises_once_is_restarted_and_logged_with_its_name(caplog):
    bg = BackgroundTasks(FAST, env={})
    bg.register("kv_events", 5.0)
    runs, stop, restarted = [], threading.Event(), threading.Event()

    def body():
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("boom")
        while not stop.is_set():
            bg.tick("kv_events")
            time.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="cpd.router.background"):
        t = threading.Thread(target=bg.run_thread, args=("kv_events", body, stop, restarted.set))
        t.start()
        deadline = time.monotonic() + 10
        while bg.report()["kv_events"]["restarts"] < 1 or bg.report()["kv_events"]["last_ok_age_s"] > 1.0:
            assert time.monotonic() < deadline, bg.report()
            time.sleep(0.01)
        stop.set()
        t.join(5)
    assert not t.is_alive() and restarted.is_set() and len(runs) == 2
    rep = bg.report()["kv_events"]
    assert rep["alive"] and rep["state"] == RUNNING and rep["last_error"] == "ValueError('boom')"
    assert bg.verdict().healthy
    died = [r for r in caplog.records if "died" in r.getMessage()]
    assert len(died) == 1 and "kv_events" in died[0].getMessage() and died[0].exc_info is not None


def test_an_async_task_that_keeps_dying_is_given_up_and_the_verdict_fails():
    bg = BackgroundTasks(FAST, env={})
    bg.register("worker_poller", 60.0)
    calls = []

    async def body():
        calls.append(1)
        await bg.atick("worker_poller")
        raise RuntimeError(f"death {len(calls)}")

    asyncio.run(asyncio.wait_for(bg.run_async("worker_poller", body), 10))
    assert len(calls) == FAST.max_restarts + 1
    v = bg.verdict()
    assert not v.healthy and v.failing == ("worker_poller",)
    assert f"died after {FAST.max_restarts} restarts: RuntimeError('death 3')" in v.reason
    assert bg.report()["worker_poller"]["alive"] is False


def test_cancelling_an_async_task_ends_it_without_a_death():
    bg = BackgroundTasks(FAST, env={})
    bg.register("maintenance", 60.0)

    async def body():
        while True:
            await bg.atick("maintenance")
            await asyncio.sleep(0.01)

    async def main():
        task = asyncio.create_task(bg.run_async("maintenance", body))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert bg.report()["maintenance"]["last_error"] is None and bg.verdict().healthy


def test_fault_file_modes(tmp_path):
    path = tmp_path / "fault.json"
    bg = BackgroundTasks(FAST, env={"CPD_FAULT_ROUTER_TASK_FILE": str(path)})
    bg.register("kv_events", 60.0)
    bg.register("maintenance", 60.0)
    bg.tick("kv_events")  # no file: nothing
    path.write_text(json.dumps({"task": "kv_events", "mode": "raise", "pid": os.getpid() + 1}))
    bg.tick("kv_events")  # another process's fault
    path.write_text(json.dumps({"task": "kv_events", "mode": "raise", "pid": os.getpid()}))
    bg.tick("maintenance")  # another task's fault
    for _ in range(2):
        with pytest.raises(InjectedTaskFault):
            bg.tick("kv_events")
    path.write_text(json.dumps({"task": "kv_events", "mode": "raise_once"}))
    with pytest.raises(InjectedTaskFault):
        bg.tick("kv_events")
    assert not path.exists()
    bg.tick("kv_events")
    path.write_text(json.dumps({"task": "kv_events", "mode": "hang"}))
    t = threading.Thread(target=bg.tick, args=("kv_events",))
    before = bg.snapshot()[0].last_ok_s
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and bg.snapshot()[0].last_ok_s == before  # blocked: no tick
    path.unlink()
    t.join(5)
    assert not t.is_alive() and bg.snapshot()[0].last_ok_s > before
