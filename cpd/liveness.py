"""Liveness of a supervised worker or router (pure policy; the probing and the kill are in :mod:`cpd.supervise`).

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

Failing engine steps (``max_failed_steps``): a worker whose engine fails (a broken device, a
corrupted executor: nothing of a step runs and the engine's canary forward fails too) answers 503
from that step on; idle, it probes its engine every ``retry_after_s``
(``engine.failed_steps_retry_after_s``, :class:`cpd.worker.runtime.StepHealth`) and answers 200
again once a probe runs. Its ``/health`` body, 200 or 503, carries ``consecutive_failed_steps``
(failed steps and probes since the last good one), so the policy restarts a worker once that count
reaches ``max_failed_steps`` (reason ``consecutive_failed_steps``; 0 turns this off), usually
before ``timeout_s`` of 503 answers would. A bad request is no failed step: it fails alone (the
engine traces a failed batched forward to it, :mod:`cpd.engine.isolation`) and the canary runs, so
no number of bad requests restarts a worker.

Answering at all (:func:`classify_answer`, the router): a process whose ``/health`` status is about
others (the router says 503 ``degraded`` while no worker is usable) is alive while it answers
anything; only ``timeout_s`` without an answer restarts it (a SIGSTOPped or wedged event loop) —
or ``timeout_s`` of 503 ``background_stalled`` answers: the router's own background work (the
KV-event subscriber, the worker poller, its maintenance loop; :mod:`cpd.router.background`) died
for good or made no progress, so it routes on a frozen index and stale loads (reason
``background_stalled``).

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
CONSECUTIVE_FAILED_STEPS = "consecutive_failed_steps"  # restart reason of the failed-steps limit
BACKGROUND_STALLED = "background_stalled"  # the router: a background task died or stalled


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one ``/health`` probe, timestamped when it was known (the answer came, or
    the probe's timeout ran out)."""

    at_s: float
    healthy: bool
    reason: str = ""  # why not healthy: engine_stuck | failed_steps | unhealthy | http_<status> | no_answer
    consecutive_failed_steps: int = 0  # as the worker reported it (200 or 503); 0 when unknown


@dataclass(frozen=True)
class LivenessPolicy:
    """When a worker that keeps failing its probes is restarted (see the module docstring)."""

    timeout_s: float = 60.0  # failing continuously this long -> restart; 0 = off
    probe_interval_s: float = 5.0
    probe_timeout_s: float = 5.0
    startup_grace_s: float = 10.0  # after READY, failures are not counted this long
    max_failed_steps: int = 0  # this many consecutive failed engine steps -> restart; 0 = off

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0 or self.max_failed_steps > 0


def classify_health(status_code: int | None, body: Any, at_s: float) -> ProbeResult:
    """A :class:`ProbeResult` from a ``/health`` answer (``status_code`` None: no answer in time or
    no connection). ``body``: the decoded JSON body, or anything else when it was not JSON."""
    if status_code is None:
        return ProbeResult(at_s, False, NO_ANSWER)
    failed_steps = _failed_steps(body)
    if status_code == 200:
        return ProbeResult(at_s, True, consecutive_failed_steps=failed_steps)
    if status_code == 503 and isinstance(body, dict):
        if body.get("stuck"):
            return ProbeResult(at_s, False, ENGINE_STUCK, failed_steps)
        if failed_steps:
            return ProbeResult(at_s, False, FAILED_STEPS, failed_steps)
        return ProbeResult(at_s, False, UNHEALTHY)
    return ProbeResult(at_s, False, f"http_{status_code}", failed_steps)


def classify_answer(status_code: int | None, body: Any, at_s: float) -> ProbeResult:
    """Liveness of a process whose ``/health`` status says more about others than about itself
    (the router: 503 ``degraded`` while no worker is usable; 401 where an operator took ``/health``
    out of ``auth.open_paths``): any HTTP answer is alive (its event loop serves), no answer in
    time fails (``no_answer``). Restarting it for a status would not bring the workers back.
    Except a 503 whose body says ``background_stalled`` (the router's own background work died or
    stalled: :mod:`cpd.router.background`): failing, reason ``background_stalled``."""
    if status_code is None:
        return ProbeResult(at_s, False, NO_ANSWER)
    if status_code == 503 and isinstance(body, dict) and body.get(BACKGROUND_STALLED):
        return ProbeResult(at_s, False, BACKGROUND_STALLED)
    return ProbeResult(at_s, True)


def _failed_steps(body: Any) -> int:
    """``consecutive_failed_steps`` of a ``/health`` body (0 when absent or not a count)."""
    n = body.get("consecutive_failed_steps") if isinstance(body, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


@dataclass
class LivenessState:
    """One process incarnation's probe history (pure). Call :meth:`on_ready` when the process
    reports READY (a new process: a new state), then :meth:`observe` with each probe result."""

    policy: LivenessPolicy
    ready_at_s: float | None = None  # None: still starting, never restarted by liveness
    failing_since_s: float | None = None  # first failed probe of the current failing run
    last_reason: str = ""  # reason of the last failed probe
    num_failed_probes: int = 0  # in the current failing run
    consecutive_failed_steps: int = 0  # as the last probe's answer reported it

    def on_ready(self, now_s: float) -> None:
        self.ready_at_s = now_s
        self._reset()

    def _reset(self) -> None:
        self.failing_since_s = None
        self.last_reason = ""
        self.num_failed_probes = 0

    def observe(self, probe: ProbeResult) -> str | None:
        """Take one probe result; returns the restart reason when the worker has failed every probe
        for ``timeout_s`` (the last failure's reason) or reports ``max_failed_steps`` consecutive
        failed engine steps (``consecutive_failed_steps``), else None."""
        if not self.policy.enabled or self.ready_at_s is None:
            return None
        self.consecutive_failed_steps = probe.consecutive_failed_steps
        if 0 < self.policy.max_failed_steps <= probe.consecutive_failed_steps:
            return CONSECUTIVE_FAILED_STEPS
        return self._timed_out(probe, self.ready_at_s) if self.policy.timeout_s > 0 else None

    def _timed_out(self, probe: ProbeResult, ready_at_s: float) -> str | None:
        """The timeout rule: the last failure's reason once every probe failed for ``timeout_s``."""
        if probe.healthy:
            self._reset()
            return None
        if probe.at_s < ready_at_s + self.policy.startup_grace_s:
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
        the last probe was good) and ``consecutive_failed_steps`` (the last answer's)."""
        return {"failing_for_s": round(self.failing_for_s(now_s), 2), "reason": self.last_reason,
                "failed_probes": self.num_failed_probes, "consecutive_failed_steps": self.consecutive_failed_steps}
