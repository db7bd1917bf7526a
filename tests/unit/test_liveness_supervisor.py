"""The supervisor's liveness mechanism (:mod:`cpd.supervise`) with real child processes and real
HTTP probes, but tiny children (a stdlib HTTP server whose ``/health`` answers what a file says,
so a test can make it unhealthy), so it runs in seconds. The whole-deployment version with real
workers is ``tests/e2e/test_liveness_restart.py``."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cpd.deploy import free_port
from cpd.liveness import (CONSECUTIVE_FAILED_STEPS, ENGINE_STUCK, NO_ANSWER, LivenessPolicy, classify_answer,
                          classify_health)
from cpd.supervise import Child, RestartPolicy, Supervisor, read_status

CHILD = r"""
import http.server, json, sys
port, state = int(sys.argv[1]), sys.argv[2]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code, body = json.loads(open(state).read())
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
OK = [200, {"status": "ok", "healthy": True}]
STUCK = [503, {"status": "error", "healthy": False, "stuck": True, "current_step_s": 99.0}]
POLICY = LivenessPolicy(timeout_s=1.5, probe_interval_s=0.2, probe_timeout_s=0.5, startup_grace_s=0.3)
BOUND_S = 10.0  # timeout + probe timeouts + restart backoff + start, with room for a loaded machine


class Fixture:
    def __init__(self, tmp: Path, wait_ready: bool = True, policy: LivenessPolicy = POLICY,
                 classify=classify_health):
        self.port = free_port()
        self.state = tmp / "health.json"
        self.set(OK)
        self.tmp = tmp
        self.child = Child("w0", "decode", self._spawn, on_started=self._on_started if wait_ready else None)
        self.child.health_url = f"http://127.0.0.1:{self.port}/health"
        self.child.classify = classify
        self.sup = Supervisor([self.child], RestartPolicy(0.2, 1.0, 60.0), tmp / "supervisor.json",
                              poll_interval_s=0.05, log_path=lambda name: tmp / f"{name}.log", liveness=policy)
        self.child.proc = self._spawn()
        self.child.started_at_s = time.monotonic()
        if wait_ready:
            self._on_started(self.child)

    def set(self, health) -> None:
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(health))
        os.replace(tmp, self.state)

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", CHILD, str(self.port), str(self.state)],
                                start_new_session=True)

    def _on_started(self, c: Child) -> None:
        """Ready once the child listens (as a worker's READY line)."""
        proc = c.proc

        def wait():
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                    if c.proc is proc:
                        c.ready.set()
                    return
                except OSError:
                    time.sleep(0.05)
        threading.Thread(target=wait, daemon=True).start()

    def wait_pid_change(self, old_pid: int, timeout_s: float = BOUND_S) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            p = self.child.proc
            if p is not None and p.pid != old_pid and p.poll() is None:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise AssertionError(f"not restarted within {timeout_s} s: {read_status(self.tmp / 'supervisor.json')}")

    def wait_ready(self, timeout_s: float = BOUND_S) -> None:
        assert self.child.ready.wait(timeout_s), "child never ready"

    def close(self) -> None:
        self.sup.pause()
        p = self.child.proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        self.sup.close()


@pytest.fixture
def fx(tmp_path):
    f = Fixture(tmp_path)
    f.wait_ready()
    f.sup.start()
    yield f
    f.close()


def test_stuck_child_is_killed_and_restarted_with_the_reason_logged_and_counted(fx, tmp_path):
    old = fx.child.proc
    fx.set(STUCK)
    t0 = time.monotonic()
    fx.wait_pid_change(old.pid)
    elapsed = time.monotonic() - t0
    fx.set(OK)  # the new process serves
    print(f"restarted {elapsed:.2f} s after it turned stuck")
    assert old.returncode == -signal.SIGKILL
    assert POLICY.timeout_s <= elapsed < BOUND_S
    fx.wait_ready()
    st = read_status(tmp_path / "supervisor.json")["processes"]["w0"]
    assert st["restarts"] == 1 and st["liveness_restarts"] == {ENGINE_STUCK: 1}, st
    assert st["last_restart_reason"] == f"liveness: {ENGINE_STUCK}", st
    log = (tmp_path / "w0.log").read_text()
    assert "failed its liveness probe" in log and f"killed: liveness: {ENGINE_STUCK}" in log, log
    time.sleep(POLICY.timeout_s * 2)  # healthy again: no second restart
    assert fx.child.restarts == 1 and fx.child.proc.poll() is None


def test_stopped_child_is_restarted(fx, tmp_path):
    old = fx.child.proc
    os.kill(old.pid, signal.SIGSTOP)
    fx.wait_pid_change(old.pid)
    assert old.returncode == -signal.SIGKILL
    st = read_status(tmp_path / "supervisor.json")["processes"]["w0"]
    assert st["liveness_restarts"] == {NO_ANSWER: 1}, st


def test_healthy_child_is_left_alone_and_a_short_unhealthy_spell_too(fx):
    pid = fx.child.proc.pid
    time.sleep(POLICY.timeout_s * 2)
    fx.set(STUCK)
    time.sleep(POLICY.timeout_s * 0.4)  # shorter than the timeout, then healthy again
    fx.set(OK)
    time.sleep(POLICY.timeout_s * 2)
    assert fx.child.proc.pid == pid and fx.child.restarts == 0 and fx.child.liveness_restarts == {}


def test_a_child_not_yet_ready_is_never_killed(tmp_path):
    f = Fixture(tmp_path, wait_ready=False)  # never reports ready
    try:
        f.set(STUCK)
        f.sup.start()
        time.sleep(POLICY.timeout_s * 3)
        assert f.child.restarts == 0 and f.child.proc.poll() is None
    finally:
        f.close()


def test_no_kill_once_paused(fx):
    old = fx.child.proc
    fx.sup.pause()  # the deployment is stopping
    fx.set(STUCK)
    time.sleep(POLICY.timeout_s * 3)
    assert old.poll() is None and fx.child.restarts == 0


def _started(tmp_path: Path, **kw) -> Fixture:
    f = Fixture(tmp_path, **kw)
    f.wait_ready()
    f.sup.start()
    return f


def test_child_reporting_failed_steps_is_restarted_even_while_it_answers_200(tmp_path):
    """A worker may answer 200 while its engine fails (a StepHealth tolerating more than one
    failure); the count in its /health body gets it restarted (reason consecutive_failed_steps), a
    count under the limit not."""
    f = _started(tmp_path, policy=dataclasses.replace(POLICY, timeout_s=0.0, max_failed_steps=3))
    try:
        old = f.child.proc
        f.set([200, {"status": "ok", "healthy": True, "consecutive_failed_steps": 2}])
        time.sleep(POLICY.probe_interval_s * 5)
        assert f.child.proc is old and f.child.restarts == 0
        assert read_status(tmp_path / "supervisor.json")["processes"]["w0"]["liveness"]["consecutive_failed_steps"] == 2
        t0 = time.monotonic()
        f.set([200, {"status": "ok", "healthy": True, "consecutive_failed_steps": 3}])
        f.wait_pid_change(old.pid)
        print(f"restarted {time.monotonic() - t0:.2f} s after the count reached the limit")
        f.set(OK)
        assert old.returncode == -signal.SIGKILL
        st = read_status(tmp_path / "supervisor.json")["processes"]["w0"]
        assert st["liveness_restarts"] == {CONSECUTIVE_FAILED_STEPS: 1}, st
        assert st["last_restart_reason"] == f"liveness: {CONSECUTIVE_FAILED_STEPS}", st
        assert "reported 3 consecutive failed engine steps" in (tmp_path / "w0.log").read_text()
    finally:
        f.close()


def test_router_child_degraded_is_left_alone_stopped_is_restarted(tmp_path):
    """The router's /health is 503 ``degraded`` while no worker is usable: alive (classify_answer);
    SIGSTOPped it answers nothing and is restarted (no_answer)."""
    f = _started(tmp_path, classify=classify_answer)
    try:
        old = f.child.proc
        f.set([503, {"status": "degraded", "workers": {"p0": False}}])
        time.sleep(POLICY.timeout_s * 2.5)
        assert f.child.proc is old and f.child.restarts == 0 and f.child.liveness_restarts == {}
        os.kill(old.pid, signal.SIGSTOP)
        f.wait_pid_change(old.pid)
        assert old.returncode == -signal.SIGKILL
        assert read_status(tmp_path / "supervisor.json")["processes"]["w0"]["liveness_restarts"] == {NO_ANSWER: 1}
    finally:
        f.close()
