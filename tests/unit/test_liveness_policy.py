"""The liveness policy (:mod:`cpd.liveness`, pure): when does a worker that keeps failing its
``/health`` probes get restarted, and when never."""
from __future__ import annotations

import pytest

from cpd.liveness import (CONSECUTIVE_FAILED_STEPS, ENGINE_STUCK, FAILED_STEPS, NO_ANSWER, UNHEALTHY, LivenessPolicy,
                          LivenessState, ProbeResult, classify_answer, classify_health)

POLICY = LivenessPolicy(timeout_s=30.0, probe_interval_s=5.0, probe_timeout_s=2.0, startup_grace_s=10.0)


def _ready_state(policy: LivenessPolicy = POLICY, at_s: float = 100.0) -> LivenessState:
    st = LivenessState(policy)
    st.on_ready(at_s)
    return st


def _feed(st: LivenessState, probes: list[ProbeResult]) -> list[str | None]:
    return [st.observe(p) for p in probes]


def _failing(start_s: float, stop_s: float, every_s: float, reason: str = ENGINE_STUCK) -> list[ProbeResult]:
    n = int((stop_s - start_s) / every_s) + 1
    return [ProbeResult(start_s + i * every_s, False, reason) for i in range(n)]


def test_restart_once_every_probe_failed_for_the_timeout_not_before():
    st = _ready_state()
    start = 200.0
    verdicts = _feed(st, _failing(start, start + 60.0, 5.0))
    first = verdicts.index(ENGINE_STUCK)
    assert all(v is None for v in verdicts[:first])
    assert first * 5.0 == pytest.approx(POLICY.timeout_s)  # the first probe at or past the timeout
    assert st.failing_for_s(start + first * 5.0) == pytest.approx(POLICY.timeout_s)


def test_the_restart_reason_is_the_last_failure():
    st = _ready_state()
    probes = _failing(200.0, 220.0, 5.0, NO_ANSWER) + _failing(225.0, 235.0, 5.0, ENGINE_STUCK)
    verdicts = _feed(st, probes)
    assert verdicts[-1] == ENGINE_STUCK
    assert [v for v in verdicts if v] == [ENGINE_STUCK, ENGINE_STUCK]  # 230 and 235 are both past 200 + 30


def test_one_good_probe_resets_the_failing_run():
    st = _ready_state()
    before = _failing(200.0, 225.0, 5.0)  # 25 s of failures, 5 s short of the timeout
    assert _feed(st, before) == [None] * len(before)
    assert st.observe(ProbeResult(230.0, True)) is None
    assert st.report(230.0) == {"failing_for_s": 0.0, "reason": "", "failed_probes": 0, "consecutive_failed_steps": 0}
    after = _failing(235.0, 264.0, 5.0)  # a new run: 29 s long, still short of the timeout
    assert _feed(st, after) == [None] * len(after)
    assert st.observe(ProbeResult(265.0, False, NO_ANSWER)) == NO_ANSWER  # 30 s after the new run began


def test_flapping_worker_is_never_restarted():
    """Unhealthy most of the time but answering 200 between: no continuous failing run reaches the
    timeout (a worker whose failed steps make it unhealthy, then healthy again to be retried)."""
    st = _ready_state()
    t, verdicts = 200.0, []
    for _ in range(40):
        verdicts += _feed(st, _failing(t, t + 25.0, 5.0, FAILED_STEPS))
        verdicts.append(st.observe(ProbeResult(t + 30.0, True)))
        t += 35.0
    assert not any(verdicts)


def test_a_worker_still_starting_is_never_restarted():
    st = LivenessState(POLICY)  # no on_ready: the worker has not reported READY
    assert not any(_feed(st, _failing(0.0, 600.0, 5.0, NO_ANSWER)))


def test_failures_in_the_startup_grace_do_not_count():
    st = _ready_state(at_s=100.0)  # grace until 110
    assert not any(_feed(st, _failing(100.0, 109.0, 1.0, NO_ANSWER)))
    assert st.failing_for_s(109.0) == 0.0
    verdicts = _feed(st, _failing(110.0, 140.0, 5.0, NO_ANSWER))
    assert verdicts[-1] == NO_ANSWER and not any(verdicts[:-1])  # counted from 110, not from 100


def test_a_new_incarnation_starts_clean():
    st = _ready_state()
    _feed(st, _failing(200.0, 225.0, 5.0))
    st.on_ready(300.0)  # restarted and READY again
    assert st.failing_since_s is None and st.num_failed_probes == 0
    assert not any(_feed(st, _failing(305.0, 320.0, 5.0)))  # grace, then only 10 s of failing


def test_needs_two_failed_probes_even_with_a_tiny_timeout():
    st = _ready_state(LivenessPolicy(timeout_s=0.01, startup_grace_s=0.0))
    assert st.observe(ProbeResult(200.0, False, NO_ANSWER)) is None
    assert st.observe(ProbeResult(201.0, False, NO_ANSWER)) == NO_ANSWER


def test_timeout_zero_turns_it_off():
    off = LivenessPolicy(timeout_s=0.0)
    assert not off.enabled
    st = _ready_state(off)
    assert not any(_feed(st, _failing(200.0, 10_000.0, 5.0)))


def test_busy_but_healthy_worker_is_never_restarted():
    st = _ready_state()
    assert not any(st.observe(ProbeResult(200.0 + 5.0 * i, True)) for i in range(1000))


@pytest.mark.parametrize("status,body,healthy,reason", [
    (200, {"status": "ok", "healthy": True}, True, ""),
    (503, {"status": "error", "healthy": False, "stuck": True, "current_step_s": 130.0}, False, ENGINE_STUCK),
    (503, {"status": "error", "healthy": False, "stuck": False, "consecutive_failed_steps": 3}, False,
     FAILED_STEPS),
    (503, {"status": "error", "healthy": False}, False, UNHEALTHY),
    (503, None, False, "http_503"),  # not the worker's JSON (a proxy, a half-started server)
    (500, "Internal Server Error", False, "http_500"),
    (None, None, False, NO_ANSWER),
])
def test_classify_health(status, body, healthy, reason):
    r = classify_health(status, body, 7.0)
    assert (r.at_s, r.healthy, r.reason) == (7.0, healthy, reason)


# --- failing engine steps (max_failed_steps) ------------------------------------------------------
STEPS = LivenessPolicy(timeout_s=30.0, probe_interval_s=5.0, probe_timeout_s=2.0, startup_grace_s=10.0,
                       max_failed_steps=4)


def _health(at_s: float, failed_steps: int, status: int | None = None) -> ProbeResult:
    """A worker's /health answer as the probe reads it: 503 from 2 failures on unless ``status``
    says otherwise (a worker may answer 200 while it counts failures), the count in both."""
    code = status if status is not None else (503 if failed_steps >= 2 else 200)
    return classify_health(code, {"healthy": code == 200, "stuck": False, "consecutive_failed_steps": failed_steps},
                           at_s)


def test_a_worker_whose_steps_keep_failing_is_restarted_although_it_flaps_back_to_200():
    """A worker whose answers alternate between 503 and 200 (so the timeout never fires) is
    restarted by the count it reports."""
    st = _ready_state(STEPS)
    probes = [_health(200.0, 1), _health(205.0, 2), _health(210.0, 2, 200), _health(215.0, 3),
              _health(220.0, 3, 200), _health(225.0, 4)]
    verdicts = _feed(st, probes)
    assert verdicts == [None] * 5 + [CONSECUTIVE_FAILED_STEPS]
    assert st.report(225.0)["consecutive_failed_steps"] == 4


def test_the_count_restarts_even_when_the_probe_itself_says_200():
    st = _ready_state(STEPS)
    assert st.observe(_health(200.0, 7, status=200)) == CONSECUTIVE_FAILED_STEPS


def test_one_bad_request_never_restarts_a_worker():
    """Counts that go back to 0 between failures never add up (today's worker does not even count a
    bad request: the engine's canary forward runs, cpd.engine.isolation)."""
    st = _ready_state(STEPS)
    probes = []
    for i in range(200):
        probes += [_health(200.0 + 10 * i, 1), _health(205.0 + 10 * i, 0)]
    assert not any(_feed(st, probes))


def test_failed_steps_limit_zero_turns_it_off_and_the_timeout_still_works():
    st = _ready_state(LivenessPolicy(timeout_s=30.0, startup_grace_s=10.0, max_failed_steps=0))
    assert st.observe(_health(200.0, 10_000, status=200)) is None
    verdicts = _feed(st, [_health(200.0 + 5 * i, 10_000, status=503) for i in range(7)])
    assert verdicts[-1] == FAILED_STEPS and not any(verdicts[:-1])  # the timeout: 30 s of 503


def test_failed_steps_alone_enables_the_policy():
    only_steps = LivenessPolicy(timeout_s=0.0, max_failed_steps=3)
    assert only_steps.enabled
    st = _ready_state(only_steps)
    assert not any(_feed(st, _failing(200.0, 10_000.0, 5.0, NO_ANSWER)))  # no timeout
    assert st.observe(_health(10_005.0, 3)) == CONSECUTIVE_FAILED_STEPS


def test_failed_steps_need_ready_like_the_rest():
    st = LivenessState(STEPS)  # not READY
    assert st.observe(_health(200.0, 100)) is None


@pytest.mark.parametrize("body,count", [
    ({"consecutive_failed_steps": 5}, 5), ({"consecutive_failed_steps": 0}, 0), ({}, 0), (None, 0),
    ({"consecutive_failed_steps": True}, 0), ({"consecutive_failed_steps": "5"}, 0),
    ({"consecutive_failed_steps": -3}, 0), ("text", 0),
])
def test_classify_health_reads_the_failed_steps_count(body, count):
    assert classify_health(200, body, 1.0).consecutive_failed_steps == count


# --- the router: any answer is alive ------------------------------------------------------------
@pytest.mark.parametrize("status,healthy,reason", [
    (200, True, ""), (503, True, ""),  # 503 "degraded": no usable worker, the router itself is fine
    (401, True, ""), (500, True, ""), (None, False, NO_ANSWER),
])
def test_classify_answer(status, healthy, reason):
    r = classify_answer(status, {"status": "degraded"}, 3.0)
    assert (r.at_s, r.healthy, r.reason) == (3.0, healthy, reason)


def test_a_degraded_router_is_never_restarted_a_silent_one_is():
    st = _ready_state()
    assert not any(_feed(st, [classify_answer(503, {"status": "degraded"}, 200.0 + 5 * i) for i in range(100)]))
    verdicts = _feed(st, [classify_answer(None, None, 800.0 + 5 * i) for i in range(7)])
    assert verdicts[-1] == NO_ANSWER and not any(verdicts[:-1])
