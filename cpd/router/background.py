"""The router's background tasks, made observable and restarted when they die.

The router's HTTP server can answer ``/health`` while the work behind it has stopped. Its
background tasks are:

* ``kv_events``: the KV-event subscriber thread (:class:`cpd.kv.event_bus.EventSubscriber`) that
  feeds the global prefix index from every worker's publisher;
* ``worker_poller``: the ``GET /load`` poller of :class:`cpd.router.workers.WorkerSet` (health,
  KV use, compatibility re-checks, roles reported by workers);
* ``maintenance``: the router's maintenance loop (rebuilds of a worker's L1/L2 entries after an
  event gap or a restart, the L3 view's rebuild from a store listing, the index-size metric);
* ``elastic``: the roles planner loop (only with ``router.elastic``).

If one of them dies or hangs, the router keeps routing on a frozen index and stale loads (wrong
placement, requests sent to workers that are gone). So each task **ticks** once per iteration
(:meth:`BackgroundTasks.tick` / :meth:`BackgroundTasks.atick`, which record the monotonic time of
its last good iteration), and runs under a wrapper (:meth:`BackgroundTasks.run_thread` /
:meth:`BackgroundTasks.run_async`) that, when the task raises, logs the exception once with the
task's name and restarts it in-process after a backoff (:class:`RestartBound`: 0.5 s, 1 s, 2 s),
calling the task's ``on_restart`` first (the event subscriber: every worker's L1/L2 entries and the
L3 view are rebuilt, since events were lost meanwhile). A task that keeps dying (more than
``max_restarts`` runs in a row, each shorter than ``stable_after_s``) is given up: dead.

:func:`background_verdict` (pure: a snapshot and ``now``) says the router is unhealthy when a task
is dead or has not ticked for longer than its stall bound (``router.background_stall_timeout_s``,
default 60 s, at least three periods of a task that sleeps longer): ``/health`` then answers 503
``background_stalled`` with the reason, the supervisor of ``cpd serve`` counts that as a failed
liveness probe (:func:`cpd.liveness.classify_answer`) and restarts the router after
``deployment.liveness_timeout_s`` (reason ``background_stalled``); the new router rebuilds its view
at start-up. A hung task (a thread cannot be stopped from outside) is never restarted in-process:
only the router's restart ends it.

Test-only fault injection (never set in production): ``CPD_FAULT_ROUTER_TASK_FILE=PATH``; while
the file exists and holds ``{"task": NAME, "mode": "raise" | "raise_once" | "hang", "pid": PID}``
(``pid`` optional: only that router process), the task ``NAME`` raises at each iteration
(``raise``), raises once and removes the file (``raise_once``), or blocks its iteration while the
file exists (``hang``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable, Mapping

from cpd.liveness import BACKGROUND_STALLED  # /health status and the supervisor's restart reason

log = logging.getLogger("cpd.router.background")

KV_EVENTS, WORKER_POLLER, MAINTENANCE, ELASTIC = "kv_events", "worker_poller", "maintenance", "elastic"
FAULT_FILE_ENV = "CPD_FAULT_ROUTER_TASK_FILE"

RUNNING, RESTARTING, DEAD = "running", "restarting", "dead"


# ---- policy (pure) -------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskState:
    """One background task at one moment (a snapshot; times are ``time.monotonic()`` seconds).

    Attributes:
        name: the task's name (``kv_events``, ``worker_poller``, ...).
        state: ``running`` | ``restarting`` (died, waiting for its in-process restart) | ``dead``
            (died too often: given up).
        started_s: when its current run (or the first one) started.
        last_ok_s: when it last completed an iteration (ticked); None: not yet in this run.
        stall_bound_s: longest time without a tick before it counts as stalled.
        restarts: in-process restarts so far.
        last_error: ``repr`` of the exception that ended its last run (None: never died).
    """

    name: str
    state: str
    started_s: float
    last_ok_s: float | None
    stall_bound_s: float
    restarts: int = 0
    last_error: str | None = None

    def silent_for_s(self, now_s: float) -> float:
        """Seconds since its last tick (since its start when it has not ticked yet)."""
        return max(0.0, now_s - (self.last_ok_s if self.last_ok_s is not None else self.started_s))


@dataclass(frozen=True)
class Verdict:
    healthy: bool
    reason: str = ""  # why not: one clause per failing task, "; "-joined
    failing: tuple[str, ...] = ()  # names of the failing tasks


def background_verdict(tasks: Iterable[TaskState], now_s: float) -> Verdict:
    """Healthy unless a task is dead or has not completed an iteration for longer than its
    stall bound (a task waiting for its in-process restart counts as silent since its last tick,
    so a restart that keeps it away longer than the bound is a stall too)."""
    reasons, failing = [], []
    for t in sorted(tasks, key=lambda t: t.name):
        if t.state == DEAD:
            reasons.append(f"background task {t.name} died after {t.restarts} restarts: {t.last_error}")
        elif t.silent_for_s(now_s) > t.stall_bound_s:
            was = f" (last error: {t.last_error})" if t.last_error and t.state == RESTARTING else ""
            reasons.append(f"background task {t.name} made no progress for {t.silent_for_s(now_s):.1f} s "
                           f"(bound {t.stall_bound_s:g} s){was}")
        else:
            continue
        failing.append(t.name)
    return Verdict(not failing, "; ".join(reasons), tuple(failing))


@dataclass(frozen=True)
class RestartBound:
    """In-process restarts of a task that raised: after ``initial_backoff_s * 2**(n-1)`` (capped)
    for the n-th death in a row; a run that lasted ``stable_after_s`` starts the count over. The
    death after ``max_restarts`` restarts in a row is final (dead: the router's restart is next)."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_restarts: int = 3
    stable_after_s: float = 60.0

    def next_deaths(self, deaths: int, ran_s: float) -> int:
        """Deaths in a row after one that ended a run of ``ran_s`` seconds."""
        return 1 if ran_s >= self.stable_after_s else deaths + 1

    def delay_s(self, deaths: int) -> float | None:
        """Wait before the restart after the ``deaths``-th death in a row; None: give up."""
        if deaths > self.max_restarts:
            return None
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, deaths - 1))


def stall_bound_s(configured_s: float, period_s: float = 0.0) -> float:
    """A task's stall bound: the configured one, but never under three of its periods."""
    return max(configured_s, 3.0 * period_s)


# ---- fault injection (tests only) ------------------------------------------------------------
class InjectedTaskFault(RuntimeError):
    """Raised by a task that the test-only fault file names."""


class _FaultFile:
    """``CPD_FAULT_ROUTER_TASK_FILE`` (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path

    def _armed(self, name: str) -> dict | None:
        try:
            with open(self.path) as f:
                spec = json.loads(f.read() or "{}")
        except (OSError, ValueError):
            return None
        if spec.get("task") != name or spec.get("pid") not in (None, os.getpid()):
            return None
        return spec

    def mode(self, name: str) -> str | None:
        spec = self._armed(name)
        if spec is None:
            return None
        mode = spec.get("mode", "raise")
        if mode == "raise_once":
            try:
                os.unlink(self.path)
            except OSError:
                return None  # someone else consumed it
        return mode


# ---- mechanism ------------------------------------------------------------------------------
@dataclass
class _Task:
    name: str
    stall_bound_s: float
    state: str = RUNNING
    started_s: float = field(default_factory=time.monotonic)
    last_ok_s: float | None = None
    restarts: int = 0
    deaths: int = 0  # in a row (RestartBound)
    last_error: str | None = None


class BackgroundTasks:
    """The router's background tasks: their ticks, deaths and restarts (thread-safe)."""

    def __init__(self, restart: RestartBound | None = None, clock: Callable[[], float] = time.monotonic,
                 env: Mapping[str, str] | None = None):
        self.restart = restart or RestartBound()
        self.clock = clock
        self._tasks: dict[str, _Task] = {}
        self._lock = threading.Lock()
        path = (os.environ if env is None else env).get(FAULT_FILE_ENV, "").strip()
        self._fault = _FaultFile(path) if path else None

    def register(self, name: str, stall_bound_s: float) -> None:
        with self._lock:
            self._tasks[name] = _Task(name, stall_bound_s, started_s=self.clock())

    def snapshot(self) -> list[TaskState]:
        with self._lock:
            return [TaskState(t.name, t.state, t.started_s, t.last_ok_s, t.stall_bound_s, t.restarts, t.last_error)
                    for t in self._tasks.values()]

    def verdict(self) -> Verdict:
        return background_verdict(self.snapshot(), self.clock())

    def report(self) -> dict:
        """For ``/health``: ``{name: {alive, state, last_ok_age_s, restarts, last_error}}``."""
        now = self.clock()
        return {t.name: {"alive": t.state != DEAD, "state": t.state,
                         "last_ok_age_s": round(t.silent_for_s(now), 3), "stall_bound_s": t.stall_bound_s,
                         "restarts": t.restarts, "last_error": t.last_error}
                for t in sorted(self.snapshot(), key=lambda t: t.name)}

    # --- called by the tasks ---------------------------------------------------------------
    def tick(self, name: str) -> None:
        """One good iteration of ``name`` (from any thread). Applies a test fault first: may raise
        :class:`InjectedTaskFault` or block (``hang``)."""
        if self._fault is not None:
            mode = self._fault.mode(name)
            while mode == "hang":
                time.sleep(0.1)
                mode = self._fault.mode(name)
            if mode in ("raise", "raise_once"):
                raise InjectedTaskFault(f"injected fault in router task {name}")
        self._ok(name)

    async def atick(self, name: str) -> None:
        """:meth:`tick` for a task on the event loop (a ``hang`` fault sleeps, never blocks the loop)."""
        if self._fault is not None:
            mode = self._fault.mode(name)
            while mode == "hang":
                await asyncio.sleep(0.1)
                mode = self._fault.mode(name)
            if mode in ("raise", "raise_once"):
                raise InjectedTaskFault(f"injected fault in router task {name}")
        self._ok(name)

    def _ok(self, name: str) -> None:
        t = self._tasks[name]
        t.last_ok_s = self.clock()  # one float store: no lock needed

    def _died(self, name: str, e: BaseException) -> float | None:
        """Record a death; returns the delay before the restart, None when the task is given up."""
        now = self.clock()
        with self._lock:
            t = self._tasks[name]
            t.deaths = self.restart.next_deaths(t.deaths, now - t.started_s)
            t.last_error = repr(e)
            delay = self.restart.delay_s(t.deaths)
            t.state = DEAD if delay is None else RESTARTING
        if delay is None:
            log.error("router background task %s died (%d deaths in a row, %d restarts): %r; not restarted "
                      "again, /health reports the router unhealthy", name, t.deaths, t.restarts, e, exc_info=e)
        else:
            log.error("router background task %s died: %r; restart in %.1f s", name, e, delay, exc_info=e)
        return delay

    def _restarted(self, name: str) -> None:
        with self._lock:
            t = self._tasks[name]
            t.state, t.started_s, t.restarts = RUNNING, self.clock(), t.restarts + 1
        log.warning("router background task %s restarted in-process (restart #%d)", name, t.restarts)

    async def run_async(self, name: str, body: Callable[[], Awaitable[None]],
                        on_restart: Callable[[], None] | None = None) -> None:
        """Run the coroutine loop ``body()`` as task ``name``; restart it when it raises (or
        returns, which a loop never should), within :class:`RestartBound`. Cancellation ends it."""
        while True:
            try:
                await body()
                raise RuntimeError(f"router background task {name} returned")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - any death is logged and counted
                delay = self._died(name, e)
            if delay is None:
                return
            await asyncio.sleep(delay)
            if on_restart is not None:
                on_restart()
            self._restarted(name)

    def run_thread(self, name: str, body: Callable[[], None], stop: threading.Event,
                   on_restart: Callable[[], None] | None = None) -> None:
        """:meth:`run_async` for a loop that runs in its own thread: ``body()`` returns when
        ``stop`` is set (a normal end), raises when it dies."""
        while not stop.is_set():
            try:
                body()
                if stop.is_set():
                    return
                raise RuntimeError(f"router background task {name} returned")
            except Exception as e:  # noqa: BLE001 - any death is logged and counted
                delay = self._died(name, e)
            if delay is None or stop.wait(delay):
                return
            if on_restart is not None:
                on_restart()
            self._restarted(name)


__all__ = ["BACKGROUND_STALLED", "BackgroundTasks", "RestartBound", "TaskState", "Verdict", "background_verdict",
           "stall_bound_s", "KV_EVENTS", "WORKER_POLLER", "MAINTENANCE", "ELASTIC"]
