"""A small multi-host lab from Linux network namespaces (issue 12 §2), for ``test_*netns*`` tests.

Topology: one *switch* namespace holding a bridge; every *host* is its own namespace with one
interface ``eth0`` (a veth whose peer is a port of the bridge) and its own address in a private
/24; the test process reaches the hosts through one more veth from the root namespace into the
bridge (address ``.1``). Processes start inside a host with ``ip netns exec`` and ``unshare -m``
with a private tmpfs on ``/dev/shm``, so no two hosts share shared memory (the KV handoff must go
over TCP, the L3 store over the network). :meth:`Lab.link` takes a host's link down/up.

:meth:`Lab.close` kills every process it started (by pid) and deletes every namespace it created
(which removes the veths and the bridge), also when a test failed. :func:`unavailable_reason`
says why the lab cannot run here (not root, no ``ip netns``), for a clear skip.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    """None when namespaces can be built here, else why not."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) or util-linux (unshare) not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the netns tests as root"
    probe = f"cpdprobe{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add is not permitted here: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> str:
    """A 10.X.Y.0/24 prefix (``"10.X.Y"``) that no route of the root namespace covers."""
    routes = _ip("-4", "route", "show", "table", "all").stdout
    for _ in range(50):
        prefix = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250) + 1}"
        if prefix + "." not in routes:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 subnet for the lab")


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class Lab:
    """Hosts on one bridge. Use as a context manager."""

    def __init__(self, log_dir: Path):
        self.tag = secrets.token_hex(2)
        self.prefix = _free_subnet()
        self.log_dir = Path(log_dir)
        self.hosts: dict[str, Host] = {}
        self.switch = f"cpd{self.tag}sw"
        self.root_if = f"cpd{self.tag}r"
        self.namespaces: list[str] = []
        self._next = 2
        self._build_switch()

    # ---- topology --------------------------------------------------------------------------
    def _build_switch(self) -> None:
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        peer = f"cpd{self.tag}rp"
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", peer, "master", "br0", "up")
        _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new host on the bridge; returns it (``.ip`` is its address)."""
        ns = f"cpd{self.tag}{name}"
        self._add_ns(ns)
        ip = f"{self.prefix}.{self._next}"
        self._next += 1
        outer, inner = f"c{self.tag}{name}o"[:15], f"c{self.tag}{name}i"[:15]
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "link", "set", inner, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("link", "set", outer, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", outer, "master", "br0", "up")
        h = self.hosts[name] = Host(name, ns, ip)
        return h

    def link(self, name: str, up: bool) -> None:
        """Take host ``name``'s only link down (packets to and from it are lost) or up again."""
        _ip("-n", self.hosts[name].ns, "link", "set", "eth0", "up" if up else "down")

    # ---- processes -------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], log_name: str, env: dict | None = None,
              stdout_pipe: bool = False) -> subprocess.Popen:
        """Run ``argv`` on host ``name`` with a private /dev/shm (``python`` = this interpreter)."""
        if argv and argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
        h = self.hosts[name]
        log = open(self.log_dir / f"{log_name}.log", "a")
        script = 'mount -t tmpfs -o size=1g tmpfs /dev/shm && exec "$@"'
        cmd = ["ip", "netns", "exec", h.ns, "unshare", "--mount", "--propagation", "private",
               "sh", "-c", script, "sh", *argv]
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE if stdout_pipe else log, stderr=log, text=True,
                             env=full_env, start_new_session=True)
        log.close()
        h.procs.append(p)
        return p

    def close(self) -> None:
        for h in self.hosts.values():
            for p in h.procs:
                stop(p)
        for ns in reversed(self.namespaces):
            _ip("netns", "del", ns, check=False)
        self.namespaces.clear()

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stop(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Stop one process this lab started (its own session: the whole group, by its pid)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    if p.stdout:
        p.stdout.close()


def wait_for(pred, timeout_s: float, what: str, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as e:  # noqa: BLE001 - keep polling; report the last error
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}: {last!r}")
