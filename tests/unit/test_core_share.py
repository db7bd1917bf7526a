"""Processor sharing of cores among co-located workers' steps (cpd.sim.core_share)."""
from __future__ import annotations

import pytest

from cpd.sim.core_share import CoreShare


def test_steps_up_to_the_core_count_run_at_full_speed():
    s = CoreShare(2)
    s.start(0.0, "a", 1.0)
    s.start(0.5, "b", 2.0)
    assert s.finish_times() == {"a": 1.0, "b": 2.5}


def test_three_steps_on_two_cores_each_get_two_thirds():
    s = CoreShare(2)
    for w in ("a", "b", "c"):
        s.start(0.0, w, 1.0)
    assert s.finish_times() == pytest.approx({"a": 1.5, "b": 1.5, "c": 1.5})


def test_a_step_speeds_up_when_another_ends():
    s = CoreShare(1)
    s.start(0.0, "a", 1.0)
    s.start(0.0, "b", 3.0)  # both at half speed: a ends at 2.0, b has 2.0 of work left
    assert s.finish_times()["a"] == pytest.approx(2.0)
    s.finish(2.0, "a")
    assert s.finish_times() == pytest.approx({"b": 4.0})  # the rest at full speed


def test_work_is_conserved():
    """Whatever the order, one core finishes total work W at time W when it is never idle."""
    s = CoreShare(1)
    s.start(0.0, "a", 0.7)
    s.start(0.2, "b", 0.4)
    s.start(0.3, "c", 0.9)
    t, left = 0.3, {"a", "b", "c"}
    while left:
        w, t = min(s.finish_times().items(), key=lambda kv: kv[1])
        s.finish(t, w)
        left.remove(w)
    assert t == pytest.approx(2.0)


def test_misuse_is_refused():
    with pytest.raises(ValueError):
        CoreShare(0)
    s = CoreShare(1)
    s.start(1.0, "a", 1.0)
    with pytest.raises(ValueError):
        s.start(1.0, "a", 1.0)
    with pytest.raises(ValueError):
        s.finish(0.5, "a")
