"""The test-only fault plan (:mod:`cpd.engine.faults`): the broken-engine fault used by the liveness
tests fails the step that triggers it and every later one, whatever it schedules."""
from __future__ import annotations

import pytest

from cpd.engine.faults import BREAK_ENV, WORKER_ENV, FaultPlan, InjectedFault


def test_break_seed_fails_every_step_from_the_trigger_on():
    plan = FaultPlan.from_env({BREAK_ENV: "55"})
    assert plan.active
    plan.check_step([1, 2])  # before the trigger: fine
    with pytest.raises(InjectedFault):
        plan.check_step([1, 55])
    for seeds in ([1], [None], [2, 3]):  # for good, whatever a step schedules
        with pytest.raises(InjectedFault, match="broken engine"):
            plan.check_step(seeds)


def test_break_seed_applies_to_the_named_worker_only_and_each_plan_breaks_alone():
    env = {BREAK_ENV: "55", WORKER_ENV: "p0"}
    assert not FaultPlan.from_env(env, worker_id="d0").active
    a, b = FaultPlan.from_env(env, worker_id="p0"), FaultPlan.from_env(env, worker_id="p0")
    with pytest.raises(InjectedFault):
        a.check_step([55])
    b.check_step([1])  # another process's plan (a restarted worker) starts unbroken


def test_a_timed_break_heals_after_break_s():
    import time

    from cpd.engine.faults import BREAK_S_ENV
    plan = FaultPlan.from_env({BREAK_ENV: "55", BREAK_S_ENV: "0.3"})
    with pytest.raises(InjectedFault):
        plan.check_step([55])
    with pytest.raises(InjectedFault, match="broken engine"):
        plan.check_step([None])  # the canary fails while broken
    time.sleep(0.35)
    plan.check_step([None])  # healed
    plan.check_step([55])  # and it does not break again
