"""``cpd serve`` supervises its children (issue 7 §4): a real ``cpd serve`` process, real
workers, real SIGKILLs.

* a killed idle decode worker is restarted on the same port within a bound, while the router and
  every other worker keep serving (requests succeed on the other decode worker meanwhile);
* with no decode worker left, requests get a fast, clear 503 (OpenAI error body);
* restarts are reported in the launcher's log, ``/cpd/processes`` and ``/metrics``;
* SIGINT to ``cpd serve`` stops every child, restarted ones included (no orphans).

Order matters inside this module: the last test stops the deployment.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import free_port
from cpd.auth import SECRET_ENV, client_auth
from cpd.supervise import RestartPolicy, read_status
from deploy_util import assert_no_leaks, complete, oracle_tokens, random_prompt, routing_record

MAX_TOKENS = 8
BACKOFF_S = 3.0  # first restart delay: leaves a window in which no decode worker runs
RESTART_BOUND_S = 90.0  # a killed worker is serving again within this (backoff + start, loaded machine)


class Serve:
    """A ``cpd serve`` child process and what a test needs to see of it (its internal secret is
    set here, so the test can sign its calls to the workers' internal endpoints)."""

    SECRET = "supervisor-test-secret"

    def __init__(self, model_dir: str, log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.out = open(log_dir / "serve.out", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cpd.cli", "serve", "--model", model_dir, "--decode", "2", "--port", str(self.port),
             "--log-dir", str(log_dir), "--num-blocks", "256", "--host-kv-bytes", str(16 << 20),
             "--torch-threads", "1", "--restart-backoff-s", str(BACKOFF_S)],
            stdout=self.out, stderr=subprocess.STDOUT, env={**os.environ, SECRET_ENV: self.SECRET})
        self.model_name = os.path.basename(model_dir)
        self.seen_pids: set[int] = set()

    def wait_up(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200 and len(self.pids()) == 5:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"cpd serve did not come up: {self.output()}")

    def output(self) -> str:
        self.out.flush()
        return (self.log_dir / "serve.out").read_text()

    def status(self) -> dict:
        return read_status(self.log_dir / "supervisor.json").get("processes", {})

    def pids(self) -> dict[str, int]:
        pids = {name: p["pid"] for name, p in self.status().items()}
        self.seen_pids.update(pids.values())
        return pids

    # duck-typed like cpd.deploy.Deployment for deploy_util helpers
    def alive_workers(self) -> list[dict]:
        ws = httpx.get(f"{self.url}/cpd/workers", timeout=5).json()
        return [{"worker_id": wid, **w} for wid, w in ws.items()]

    def internal_client_auth(self):
        return client_auth(self.SECRET.encode())

    def pool_stats(self) -> dict[str, dict]:
        return {w["worker_id"]: httpx.get(f"{w['url']}/load", timeout=5, auth=self.internal_client_auth()).json()["pool"]
                for w in self.alive_workers()}

    def wait_serving(self, timeout_s: float = RESTART_BOUND_S) -> float:
        """Wait until every process is up and ready and the router sees every worker healthy;
        returns the seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            st = self.status()
            if st and all(p["alive"] and p["ready"] for p in st.values()):
                try:
                    h = httpx.get(f"{self.url}/health", timeout=2)
                    if h.status_code == 200 and all(h.json()["workers"].values()):
                        self.pids()
                        return time.monotonic() - t0
                except (httpx.HTTPError, ValueError):
                    pass
            time.sleep(0.2)
        raise AssertionError(f"not serving again within {timeout_s} s: {self.status()}\n{self.output()[-3000:]}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def serve(tiny_model_dir, tmp_path_factory):
    s = Serve(tiny_model_dir, tmp_path_factory.mktemp("serve"))
    try:
        s.wait_up()
        yield s
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGINT)
            try:
                s.proc.wait(60)
            except subprocess.TimeoutExpired:
                s.proc.kill()
        s.out.close()


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    if "serve" in request.fixturenames:
        s = request.getfixturevalue("serve")
        if s.proc.poll() is None:
            s.wait_serving()
            assert_no_leaks(s)


def _metric(text: str, name: str, process: str) -> float | None:
    m = re.search(rf'^{name}\{{process="{process}",role="[^"]*"\}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_restart_policy_backs_off_exponentially_and_resets():
    p = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=8.0, stable_after_s=60.0)
    failures, delays = 0, []
    for _ in range(6):  # quick exits in a row
        failures = p.next_failures(failures, uptime_s=2.0)
        delays.append(p.delay_s(failures))
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert p.delay_s(p.next_failures(failures, uptime_s=61.0)) == 1.0  # ran long enough: starts over


def test_crash_looping_child_backs_off_and_never_stops_the_others(tmp_path):
    """Real processes under :class:`Supervisor`: one exits at once every time, one keeps running.
    The crashing one is restarted with growing delays; the other is never touched; after
    pause() nothing is restarted any more."""
    from cpd.supervise import Child, Supervisor

    def spawner(code: str):
        return lambda: subprocess.Popen([sys.executable, "-c", code])
    crash = Child("crash", "prefill", spawner("import sys; sys.exit(3)"))
    steady = Child("steady", "decode", spawner("import time; time.sleep(60)"))
    for c in (crash, steady):
        c.proc, c.started_at_s = c.spawn(), time.monotonic()
    starts = []
    crash.on_started = lambda c: starts.append(time.monotonic())
    sup = Supervisor([crash, steady], RestartPolicy(0.2, 0.8, 60.0), tmp_path / "status.json", poll_interval_s=0.02)
    steady_pid = steady.proc.pid
    sup.start()
    try:
        deadline = time.monotonic() + 20
        while len(starts) < 5:
            assert time.monotonic() < deadline, starts
            time.sleep(0.05)
        sup.pause()
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        # delays 0.4, 0.8, 0.8, 0.8 between restarts 1..5 (plus the child's own run time)
        assert gaps[0] >= 0.4 and all(g >= 0.8 for g in gaps[1:]), gaps
        assert steady.alive() and steady.proc.pid == steady_pid and steady.restarts == 0
        st = read_status(tmp_path / "status.json")["processes"]
        assert st["crash"]["restarts"] >= 5 and st["crash"]["last_exit_code"] == 3 and st["steady"]["restarts"] == 0
        n = crash.restarts
        time.sleep(1.5)
        assert crash.restarts == n  # paused: no more restarts
    finally:
        sup.close()
        for c in (crash, steady):
            if c.alive():
                c.proc.kill()
                c.proc.wait(10)


def test_killed_idle_decode_worker_restarts_others_keep_serving(serve, tiny_model_dir):
    before = serve.pids()
    os.kill(before["d0"], signal.SIGKILL)
    t_kill = time.monotonic()
    # Meanwhile the router and every other worker keep serving: the other decode worker takes
    # the requests (a request that hit the dead one before the router noticed is retried there).
    for i in range(3):
        prompt = random_prompt(300 + i, 60)
        t0 = time.monotonic()
        out = complete(serve, prompt, MAX_TOKENS)
        assert time.monotonic() - t0 < 30
        assert out["choices"][0]["token_ids"] == oracle_tokens(tiny_model_dir, prompt, MAX_TOKENS)
        assert routing_record(serve, out["id"])["decode_worker"] == "d1"
    back_s = serve.wait_serving()
    after = serve.pids()
    assert after["d0"] != before["d0"]  # a new process ...
    assert {k: v for k, v in after.items() if k != "d0"} == {k: v for k, v in before.items() if k != "d0"}  # ... only
    assert time.monotonic() - t_kill < RESTART_BOUND_S
    print(f"d0 serving again {time.monotonic() - t_kill:.1f} s after SIGKILL (waited {back_s:.1f} s)")
    st = serve.status()["d0"]
    assert st["restarts"] == 1 and st["last_exit_code"] == -signal.SIGKILL
    # reported: launcher log, /cpd/processes, /metrics
    assert re.search(r"process d0 \(decode, pid \d+\) exited with code -9", serve.output())
    assert "restarted d0 (decode)" in serve.output()
    assert httpx.get(f"{serve.url}/cpd/processes", timeout=5).json()["d0"]["restarts"] == 1
    text = httpx.get(f"{serve.url}/metrics", timeout=5).text
    assert _metric(text, "cpd_process_restarts_total", "d0") == 1.0
    assert _metric(text, "cpd_process_restarts_total", "d1") == 0.0
    assert _metric(text, "cpd_process_up", "d0") == 1.0
    # the restarted worker serves again (same port: the router's config is still valid); an idle
    # pool picks d0 first on ties, so it takes requests with the oracle's tokens
    decoded_by = set()
    for i in range(3):
        prompt = random_prompt(310 + i, 60)
        out = complete(serve, prompt, MAX_TOKENS)
        assert out["choices"][0]["token_ids"] == oracle_tokens(tiny_model_dir, prompt, MAX_TOKENS)
        decoded_by.add(routing_record(serve, out["id"])["decode_worker"])
    assert "d0" in decoded_by


def test_no_decode_worker_left_fast_clear_503_then_recovers(serve, tiny_model_dir):
    pids = serve.pids()
    for wid in ("d0", "d1"):
        os.kill(pids[wid], signal.SIGKILL)
    deadline = time.monotonic() + 15  # the router notices within a few polls
    while time.monotonic() < deadline:
        workers = httpx.get(f"{serve.url}/health", timeout=5).json()["workers"]
        if not workers["d0"] and not workers["d1"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"router still sees a decode worker: {workers}")
    prompt = random_prompt(320, 60)
    body = {"model": serve.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    t0 = time.monotonic()
    r = httpx.post(f"{serve.url}/v1/completions", json=body, timeout=30)
    took_s = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert took_s < 2.0, took_s
    assert set(r.json()["error"]) >= {"message", "type", "code"}
    assert "decode" in r.json()["error"]["message"]
    assert all(p == serve.status()[w]["pid"] for w, p in pids.items() if w not in ("d0", "d1"))  # others untouched
    serve.wait_serving()
    out = complete(serve, prompt, MAX_TOKENS)
    assert out["choices"][0]["token_ids"] == oracle_tokens(tiny_model_dir, prompt, MAX_TOKENS)


def test_sigint_stops_every_child(serve):
    pids = serve.pids()
    assert len(pids) == 5  # router + pp0 + p0 + d0 + d1
    # this deployment's config files (router.toml, workers.toml): every child names one of them
    markers = {_cmdline(p).split("--config ")[1].split()[0] for p in pids.values()}
    serve.proc.send_signal(signal.SIGINT)
    assert serve.proc.wait(60) == 0
    assert "stopped" in serve.output()
    left = [p for p in serve.seen_pids if os.path.exists(f"/proc/{p}") and "cpd." in _cmdline(p)]
    assert not left, f"children still running after SIGINT: {left}"
    orphans = [d for d in os.listdir("/proc") if d.isdigit() and any(m in _cmdline(int(d)) for m in markers)]
    assert not orphans, f"processes of this deployment still running: {orphans}"
