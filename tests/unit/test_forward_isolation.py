"""The bisection that traces a failed batched forward to its culprits (:mod:`cpd.engine.isolation`)."""
from __future__ import annotations

import math

import pytest

from cpd.engine.isolation import MAX_ISOLATION_FORWARDS, isolate


class Device:
    """A forward that fails whenever a part holds one of ``bad`` (records each run)."""

    def __init__(self, bad: set[int], broken: bool = False):
        self.bad, self.broken, self.runs = bad, broken, []

    def run(self, part):
        self.runs.append(list(part))
        if self.broken or self.bad & set(part):
            return RuntimeError(f"fails with {sorted(self.bad & set(part))}")
        return None


@pytest.mark.parametrize("n,bad", [(1, {0}), (2, {1}), (7, {3}), (16, {0, 15}), (64, {5}), (33, {1, 2, 30})])
def test_bisection_blames_exactly_the_culprits_within_its_bound(n, bad):
    dev = Device(bad)
    failed = isolate(list(range(n)), RuntimeError("step"), dev.run, max_runs=10_000)
    assert set(failed) == bad
    assert len(dev.runs) <= 2 * len(bad) * max(1, math.ceil(math.log2(n)))
    assert all("fails with" in str(e) for i, e in failed.items() if n > 1)


def test_a_transient_failure_blames_nobody():
    assert isolate(list(range(8)), RuntimeError("once"), Device(set()).run) == {}


def test_the_budget_bounds_the_extra_forwards_and_blames_what_it_cannot_split():
    dev = Device(set(), broken=True)  # everything fails: the worst case
    failed = isolate(list(range(256)), RuntimeError("step"), dev.run)
    assert len(dev.runs) <= MAX_ISOLATION_FORWARDS
    assert set(failed) == set(range(256))  # nothing ran: all blamed (the engine's canary decides more)


def test_one_culprit_among_256_is_found_within_the_default_budget():
    dev = Device({200})
    assert set(isolate(list(range(256)), RuntimeError("step"), dev.run)) == {200}
    assert len(dev.runs) <= MAX_ISOLATION_FORWARDS
