"""Liveness of a supervised worker (pure policy; the probing and the kill are in :mod:`cpd.supervise`).

A worker can be alive as a process and still out of service for good: its engine step never
returns (the worker says ``engine_stuck`` on ``/health`` once the step has run
``engine.max_step_s``), or the process no longer answers at all (SIGSTOPped, a wedged event loop).
The router routes around such a worker, but nothing brings it back. The supervisor therefore
probes each ready worker's ``/health`` every ``probe_interval_s`` (a probe that gets no answer
within ``probe_timeout_s`` counts as failed, reason ``no_answer``) and feeds the results to a
:class:`LivenessState`, which answers "restart now" once the worker has failed **every** probe for
``timeout_s`` (as a Kubernetes liveness probe restarts a pod):

* hysteresis: one good probe ends the failing run; the clock starts again at the next failure;
* start-up: a worker that has not reported READY is never probed, so never restarted by this
  (the supervisor's start-up bounds apply); failures in the first ``startup_grace_s`` after READY
  are not counted (the HTTP server may not listen yet);
* ``timeout_s == 0`` turns it off.

What counts as failing: any answer but 200 (503 ``engine_stuck``, 503 after failing steps) and
no answer in time. A stuck engine is restarted about ``engine.max_step_s + timeout_s`` after its
step began; an unresponsive process about ``timeout_s`` after it stopped answering (plus up to one
probe interval and timeout). A worker that is merely busy (long queues, every step short) answers
200 and is never restarted.

Pure: no I/O, no clock reads; times are the caller's (``time.monotonic()`` in the supervisor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NO_ANSWER = "no_answer"
ENGINE_STUCK = "engine_stuck"
FAILED_STEPS = "failed_steps"
UNHEALTHY = "unhealthy"


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one ``/health`` probe, timestamped when it was known (the answer came, or
    the probe's timeout ran out)."""

    at_s: float
    healthy: bool
    reason: str = ""  # why not healthy: engine_stuck | failed_steps | unhealthy | http_<status> | no_answer


@dataclass(frozen=True)
class LivenessPolicy:
    """When a worker that keeps failing its probes is restarted (see the module docstring)."""

    timeout_s: float = 60.0  # failing continuously this long -> restart; 0 = off
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 5.0
    startup_grace_s: float = 10.0  # after READY, failures are not counted this long

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


def classify_health(status_code: int | None, body: Any, at_s: float) -> ProbeResult:
    """A :class:`ProbeResult` from a ``/health`` answer (``status_code`` None: no answer in time or
    no connection). ``body``: the decoded JSON body, or anything else when it was not JSON."""
    if status_code is None:
        return ProbeResult(at_s, False, NO_ANSWER)
    if status_code == 200:
        return ProbeResult(at_s, True)
    if status_code == 503 and isinstance(body, dict):
        if body.get("stuck"):
            return ProbeResult(at_s, False, ENGINE_STUCK)
        if body.get("consecutive_failed_steps"):
            return ProbeResult(at_s, False, FAILED_STEPS)
        return ProbeResult(at_s, False, UNHEALTHY)
    return ProbeResult(at_s, False, f"http_{status_code}")


@dataclass
class LivenessState:
    """One process incarnation's probe history (pure). Call :meth:`on_ready` when the process
    reports READY (a new process: a new state), then :meth:`observe` with each probe result."""

    policy: LivenessPolicy
    ready_at_s: float | None = None  # None: still starting, never restarted by liveness
    failing_since_s: float | None = None  # first failed probe of the current failing run
    last_reason: str = ""  # reason of the last failed probe
    num_failed_probes: int = 0  # in the current failing run

    def on_ready(self, now_s: float) -> None:
        self.ready_at_s = now_s
        self._reset()

    def _reset(self) -> None:
        self.failing_since_s = None
        self.last_reason = ""
        self.num_failed_probes = 0

    def observe(self, probe: ProbeResult) -> str | None:
        """Take one probe result; returns the restart reason (the last failure's reason) when the
        worker has failed every probe for ``timeout_s``, else None."""
        if not self.policy.enabled or self.ready_at_s is None:
            return None
        if probe.healthy:
            self._reset()
            return None
        if probe.at_s < self.ready_at_s + self.policy.startup_grace_s:
            return None
        if self.failing_since_s is None:
            self.failing_since_s = probe.at_s
        self.num_failed_probes += 1
        self.last_reason = probe.reason or UNHEALTHY
        return self.last_reason if self.failing_for_s(probe.at_s) >= self.policy.timeout_s else None

    def failing_for_s(self, now_s: float) -> float:
        """How long the current failing run has lasted at ``now_s`` (0: not failing)."""
        return 0.0 if self.failing_since_s is None else max(0.0, now_s - self.failing_since_s)

    def report(self, now_s: float) -> dict:
        """For the status file: ``{"failing_for_s", "reason", "failed_probes"}`` (all zero/empty when
        the last probe was good)."""
        return {"failing_for_s": round(self.failing_for_s(now_s), 2), "reason": self.last_reason,
                "failed_probes": self.num_failed_probes}
