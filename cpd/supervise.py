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
* Only :meth:`Supervisor.pause` (called by ``Deployment.stop``, i.e. Ctrl-C/SIGTERM of
  ``cpd serve``) ends restarting. The supervisor thread lives until :meth:`close`, because the
  children it forked carry ``PR_SET_PDEATHSIG`` bound to it: they are stopped in order first.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

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

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Watches children and restarts the ones that exit (a daemon thread, ``poll_interval_s``)."""

    def __init__(self, children: list[Child], policy: RestartPolicy, status_path: Path,
                 poll_interval_s: float = 0.2, log_path: Callable[[str], Path] | None = None):
        self.children = {c.name: c for c in children}
        self.policy = policy
        self.status_path = Path(status_path)
        self.poll_interval_s = poll_interval_s
        self.log_path = log_path
        self._paused = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.write_status()
        self._thread = threading.Thread(target=self._run, name="cpd-supervisor", daemon=True)
        self._thread.start()

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
        msg = (f"process {c.name} ({c.role}, pid {c.proc.pid}) exited with code {c.last_exit_code} after "
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
                                       "restart_pending": c.restart_at_s is not None}
                              for c in self.children.values()}}

    def write_status(self) -> None:
        """Atomic rewrite of the status file (temp file + rename)."""
        tmp = self.status_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.status()))
            os.replace(tmp, self.status_path)
        except OSError as e:
            log.warning("cannot write supervisor status %s: %r", self.status_path, e)


def read_status(path: str | os.PathLike) -> dict:
    """The status file as a dict (``{}`` if absent or being replaced)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
