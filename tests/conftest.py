"""Shared fixtures: a real Redis server (Debian's redis-server) on a free port."""
from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cpd.deploy import free_port  # noqa: F401  (the one port chooser: outside the ephemeral range, never twice)

SHARED = Path(__file__).resolve().parents[2] / "shared"
TRACE = SHARED / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"




class RedisServer:
    """A real redis-server child process on 127.0.0.1 (stop/start to inject outages)."""

    def __init__(self, tmp: Path, extra_args: tuple[str, ...] = ()):
        self.port = free_port()
        self.dir = tmp
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server not installed (make test installs Debian's redis-server)")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small random-weight Llama that reuses the real SmolLM2 tokenizer."""
    from cpd.engine.weights import make_tiny_llama_dir
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("models") / "tiny-llama", seed=0))


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory):
    """A real redis-server shared by one test module."""
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.stop()


class DelayProxy:
    """A TCP proxy in front of a server whose forwarding can be delayed (a slow store)."""

    def __init__(self, port: int):
        self.upstream = port
        self.delay_s = 0.0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                c.close()
                continue
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        try:
            while True:
                d = a.recv(1 << 16)
                if not d:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                b.sendall(d)
        except OSError:
            pass
        finally:
            for x in (a, b):
                try:
                    x.close()
                except OSError:
                    pass

    def close(self):
        self.closed = True
        self.sock.close()


@pytest.fixture(scope="module")
def store_proxy(module_redis):
    """Workers reach the module's Redis through this proxy, so a test can make the store slow."""
    p = DelayProxy(module_redis.port)
    yield p
    p.close()
