"""Supervision of a deployment's child processes (used by :class:`cpd.deploy.Deployment`).

Design:

* A child that exits while the deployment runs (crash, OOM kill, a stray SIGKILL) is restarted
  with the **same command line** — same ports, same worker id — so the router's config stays
  valid: the router's poller sees the worker fail, drops its index entries, sees it answer
  again and re-syncs its L1/L2 view from ``/kv_snapshot``. A restarted router rebuilds its
  view the same way at start-up.
* Restarts back off exponentially (:class:`RestartPolicy`, pure): ``initial * 2**(n-1)`` for
  the n-th consecutive quick exit, capped; an exit after the child ran ``stable_after_s`` counts
  as the first again. A child that cannot start at all is retried forever at the cap, never
  stopping the other processes.
* Every exit and restart is logged (logger ``cpd.deploy``, and a line in the child's own log
  file) and counted in a small JSON **status file** (``status_path``; written atomically) that
  the router turns into metrics (``cpd_process_restarts_total``, ``cpd_process_up``) and serves
  at ``GET /cpd/processes``.
* Liveness (:mod:`cpd.liveness`): a child with a ``health_url`` (the workers and the router) is
  probed every ``probe_interval_s`` by its own thread (off the supervisor's loop: a probe of a
  stopped process waits ``probe_timeout_s``) once it has reported READY; ``Child.classify`` reads
  the answer (workers: :func:`~cpd.liveness.classify_health`; the router, whose ``/health`` is 503
  ``degraded`` while no worker is usable: :func:`~cpd.liveness.classify_answer`, any answer is
  alive except 503 ``background_stalled``: one of its background tasks died or stalled,
  :mod:`cpd.router.background`). When the pure :class:`LivenessState` says the child has failed every probe for
  ``timeout_s`` (engine stuck, no answer) or reports ``max_failed_steps`` consecutive failed engine
  steps, its process group is SIGKILLed (works on a SIGSTOPped process too) and the ordinary exit
  path above restarts it with the same command line. The kill is logged with its reason and counted per reason in the
  status file (``liveness_restarts``, exported as ``cpd_process_liveness_restarts_total``).
* Only :meth:`Supervisor.pause` (called by ``Deployment.stop``, i.e. Ctrl-C/SIGTERM of
  ``cpd serve``) ends restarting. The supervisor thread lives until :meth:`close`, because the
  children it forked carry ``PR_SET_PDEATHSIG`` bound to it: they are stopped in order first.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cpd.liveness import CONSECUTIVE_FAILED_STEPS, LivenessPolicy, LivenessState, ProbeResult, classify_health

log = logging.getLogger("cpd.deploy")


@dataclass(frozen=True)
class RestartPolicy:
    """Exponential backoff for restarts (pure)."""

    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0  # a child that ran this long before exiting starts the backoff over

    def next_failures(self, failures: int, uptime_s: float) -> int:
        """Consecutive-failure count after an exit following ``uptime_s`` of running."""
        return 1 if uptime_s >= self.stable_after_s else failures + 1

    def delay_s(self, failures: int) -> float:
        """Wait before restart number ``failures`` of a consecutive run of exits (>= 1)."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, failures - 1))


@dataclass
class Child:
    """One supervised process: a worker (``name`` = worker id) or the router (``"router"``)."""

    name: str
    role: str  # pre-prefill | prefill | decode | router
    spawn: Callable[[], subprocess.Popen]  # starts the process with its fixed command line
    proc: subprocess.Popen | None = None
    restarts: int = 0
    failures: int = 0  # consecutive quick exits (backoff exponent)
    started_at_s: float = 0.0  # time.monotonic() of the last start
    restart_at_s: float | None = None  # pending restart (monotonic), None if running
    last_exit_code: int | None = None
    on_started: Callable[["Child"], None] | None = None  # e.g. wait for the worker's READY line
    ready: threading.Event = field(default_factory=threading.Event)
    health_url: str | None = None  # probed for liveness once ready (/health); None: not probed
    classify: Callable[[int | None, Any, float], ProbeResult] = classify_health  # reads a probe's answer
    kill_reason: str | None = None  # set when the supervisor killed it (liveness), read by the exit path
    last_restart_reason: str | None = None  # why the last restart happened ("exit code 1", "liveness: no_answer")
    liveness_restarts: dict[str, int] = field(default_factory=dict)  # liveness kills per reason
    liveness: dict | None = None  # the last probe verdict (LivenessState.report), for the status file

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Watches children and restarts the ones that exit (a daemon thread, ``poll_interval_s``)."""

    def __init__(self, children: list[Child], policy: RestartPolicy, status_path: Path,
                 poll_interval_s: float = 0.2, log_path: Callable[[str], Path] | None = None,
                 liveness: LivenessPolicy | None = None,
                 probe: Callable[[str, float], tuple[int | None, Any]] | None = None):
        """``liveness``: restart children with a ``health_url`` that keep failing their probes (None
        or ``timeout_s == 0``: off). ``probe(url, timeout_s)`` -> ``(status_code or None, JSON body)``
        (default :func:`http_probe`)."""
        self.children = {c.name: c for c in children}
        self.liveness = liveness if liveness is not None and liveness.enabled else None
        self.probe = probe or http_probe
        self.policy = policy
        self.status_path = Path(status_path)
        self.poll_interval_s = poll_interval_s
        self.log_path = log_path
        self._paused = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._status_lock = threading.Lock()  # status writers: the loop, liveness and ready threads
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.write_status()
        self._thread = threading.Thread(target=self._run, name="cpd-supervisor", daemon=True)
        self._thread.start()
        if self.liveness is not None:
            for c in self.children.values():
                if c.health_url:
                    threading.Thread(target=self._watch_liveness, args=(c,), name=f"cpd-liveness-{c.name}",
                                     daemon=True).start()

    def pause(self) -> None:
        """No more restarts (the deployment is stopping); the thread stays up until close().
        On return no restart is in progress and none will start."""
        self._paused.set()
        with self._lock:
            pass

    def close(self) -> None:
        self._paused.set()
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)

    # --- loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed.is_set():
            if not self._paused.is_set():
                self.check_once()
            self._closed.wait(self.poll_interval_s)

    def check_once(self) -> None:
        now = time.monotonic()
        changed = False
        with self._lock:
            for c in self.children.values():
                if self._paused.is_set():
                    break
                if c.restart_at_s is None and c.proc is not None and c.proc.poll() is not None:
                    self._on_exit(c, now)
                    changed = True
                elif c.restart_at_s is not None and now >= c.restart_at_s:
                    self._restart(c)
                    changed = True
        if changed:
            self.write_status()

    def _on_exit(self, c: Child, now: float) -> None:
        c.ready.clear()
        assert c.proc is not None  # only a started child exits
        c.last_exit_code = c.proc.returncode
        uptime_s = now - c.started_at_s
        c.failures = self.policy.next_failures(c.failures, uptime_s)
        delay_s = self.policy.delay_s(c.failures)
        c.restart_at_s = now + delay_s
        c.last_restart_reason = c.kill_reason or f"exit code {c.last_exit_code}"
        killed = f" (killed: {c.kill_reason})" if c.kill_reason else ""
        c.kill_reason = None
        msg = (f"process {c.name} ({c.role}, pid {c.proc.pid}) exited with code {c.last_exit_code}{killed} after "
               f"{uptime_s:.1f} s; restart #{c.restarts + 1} in {delay_s:.1f} s")
        log.warning(msg)
        self._note(c, msg)

    def _restart(self, c: Child) -> None:
        c.restart_at_s = None
        c.started_at_s = time.monotonic()
        try:
            c.proc = c.spawn()
        except OSError as e:  # could not even fork/exec: counts as a quick exit
            log.error("restart of %s failed: %r", c.name, e)
            c.failures += 1
            c.restart_at_s = time.monotonic() + self.policy.delay_s(c.failures)
            return
        c.restarts += 1
        log.warning("restarted %s (%s) as pid %d (restart #%d)", c.name, c.role, c.proc.pid, c.restarts)
        self._note(c, f"restarted as pid {c.proc.pid} (restart #{c.restarts})")
        if c.on_started is not None:
            c.on_started(c)

    # --- liveness ----------------------------------------------------------------------------
    def _watch_liveness(self, c: Child) -> None:
        """Probe ``c`` every ``probe_interval_s`` while it runs and is ready; kill it when the
        policy says so (one thread per probed child, so a probe that hangs delays no other)."""
        assert self.liveness is not None and c.health_url
        policy = self.liveness
        state: LivenessState | None = None
        watched: subprocess.Popen | None = None
        while not self._closed.wait(policy.probe_interval_s):
            p = c.proc
            if (self._paused.is_set() or p is None or not c.ready.is_set() or c.restart_at_s is not None
                    or p.poll() is not None):
                state = None  # starting, restarting or stopping: never probed
                c.liveness = None
                continue
            if state is None or p is not watched:  # a new process incarnation
                state, watched = LivenessState(policy), p
                state.on_ready(time.monotonic())
            status_code, body = self.probe(c.health_url, policy.probe_timeout_s)
            now = time.monotonic()
            reason = state.observe(c.classify(status_code, body, now))
            before, c.liveness = c.liveness, state.report(now)
            if reason is not None:
                self._kill_for_liveness(c, p, reason, _verdict(state, reason, now))
                state = None
            elif _changed(before, c.liveness):
                self.write_status()  # failing started or ended: visible at /cpd/processes

    def _kill_for_liveness(self, c: Child, p: subprocess.Popen, reason: str, verdict: str) -> None:
        """SIGKILL ``p``'s process group (its own session under Deployment), unless the deployment
        is stopping or ``p`` already exited or was replaced; the exit path restarts it."""
        with self._lock:
            if self._paused.is_set() or c.proc is not p or p.poll() is not None:
                return
            c.kill_reason = f"liveness: {reason}"
            c.liveness_restarts[reason] = c.liveness_restarts.get(reason, 0) + 1
            msg = f"process {c.name} ({c.role}, pid {p.pid}) {verdict}; killing it (SIGKILL) for a restart"
            log.warning(msg)
            self._note(c, msg)
            _kill_group(p)
        self.write_status()

    def _note(self, c: Child, msg: str) -> None:
        """One line in the child's own log file, so its log tells its own history."""
        if self.log_path is None:
            return
        try:
            with open(self.log_path(c.name), "a") as f:
                f.write(f"--- cpd supervisor {time.strftime('%Y-%m-%dT%H:%M:%S')}: {msg}\n")
        except OSError:
            pass

    # --- status ----------------------------------------------------------------------------
    def status(self) -> dict:
        return {"updated_at": time.time(),
                "processes": {c.name: {"role": c.role, "pid": c.proc.pid if c.proc else None, "alive": c.alive(),
                                       "ready": c.ready.is_set(), "restarts": c.restarts,
                                       "last_exit_code": c.last_exit_code,
                                       "restart_pending": c.restart_at_s is not None,
                                       "last_restart_reason": c.last_restart_reason,
                                       "liveness_restarts": dict(c.liveness_restarts),
                                       "liveness": c.liveness}
                              for c in self.children.values()}}

    def write_status(self) -> None:
        """Atomic rewrite of the status file (temp file + rename)."""
        tmp = self.status_path.with_suffix(".tmp")
        with self._status_lock:
            try:
                tmp.write_text(json.dumps(self.status()))
                os.replace(tmp, self.status_path)
            except OSError as e:
                log.warning("cannot write supervisor status %s: %r", self.status_path, e)


def _verdict(state: LivenessState, reason: str, now_s: float) -> str:
    """Why the liveness policy said restart, for the log."""
    if reason == CONSECUTIVE_FAILED_STEPS:
        return f"reported {state.consecutive_failed_steps} consecutive failed engine steps"
    return (f"failed its liveness probe for {state.failing_for_s(now_s):.1f} s ({state.num_failed_probes} probes, "
            f"last: {reason})")


def _changed(before: dict | None, after: dict) -> bool:
    """Whether a liveness report differs from the last one in what ``/cpd/processes`` should show at
    once (failing started or ended, the failed-steps count moved)."""
    keys = ("reason", "consecutive_failed_steps")
    return any((before or {}).get(k) != after.get(k) for k in keys)


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the process group ``p`` leads (its children too), else ``p`` alone."""
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, signal.SIGKILL)
            return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.kill()
    except ProcessLookupError:
        pass


def http_probe(url: str, timeout_s: float, auth: Any = None) -> tuple[int | None, Any]:
    """GET ``url``: ``(status code, JSON body or None)``, ``(None, None)`` without an answer in
    ``timeout_s`` (or no connection)."""
    import httpx
    try:
        r = httpx.get(url, timeout=timeout_s, auth=auth)
    except httpx.HTTPError:
        return None, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def read_status(path: str | os.PathLike) -> dict:
    """The status file as a dict (``{}`` if absent or being replaced)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
