"""Start and stop a whole CPD deployment on one host: worker processes + router process.

Used by ``cpd serve``, ``make demo`` and the tests. Every process is a child that
dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so no orphans are left even if
the launcher is killed.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROLE_PREFIX = {"pre-prefill": "pp", "prefill": "p", "decode": "d"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class DeploymentConfig:
    """What to start. Pool sizes: ``pd`` topology means no pre-prefill pool."""

    model_dir: str
    topology: str = "cpd"
    num_pre_prefill: int = 1
    num_prefill: int = 1
    num_decode: int = 1
    kv_store: str = ""  # "" = a fresh file:// store under /dev/shm, removed at stop
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    num_blocks: int = 1024
    l3_chunk_blocks: int = 0  # 0 = the store URL's chunk_blocks, else 1
    block_size: int = 16
    host_kv_bytes: int = 256 << 20
    cold_threshold: float = 0.5
    max_num_batched_tokens: int = 512
    max_prefill_chunk_tokens: int = 512
    max_num_seqs: int = 32
    torch_threads: int = 0  # 0 = cores / workers, at least 1
    max_in_flight: int = 256
    max_decode_per_worker: int = 0  # 0 = 2 x max_num_seqs
    handoff_force_tcp: bool = False  # use the cross-host (TCP) handoff path even on one host
    model_name: str = ""
    extra_env: dict = field(default_factory=dict)

    def roles(self) -> list[str]:
        pre = self.num_pre_prefill if self.topology == "cpd" else 0
        return ["pre-prefill"] * pre + ["prefill"] * self.num_prefill + ["decode"] * self.num_decode


class DeploymentError(RuntimeError):
    pass


class Deployment:
    """A running deployment. Use as a context manager or call start()/stop()."""

    def __init__(self, cfg: DeploymentConfig, log_dir: str | None = None):
        self.cfg = cfg
        self.procs: list[subprocess.Popen] = []
        self.workers: list[dict] = []
        self.router_proc: subprocess.Popen | None = None
        self.port = cfg.port or free_port()
        self.url = f"http://{cfg.host}:{self.port}"
        self._own_store: str | None = None
        self._worker_procs: dict[str, subprocess.Popen] = {}
        self._tmp = tempfile.mkdtemp(prefix="cpd-deploy-")
        self.log_dir = Path(log_dir or self._tmp)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # --- lifecycle -----------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> "Deployment":
        kv_store = self.cfg.kv_store
        if not kv_store:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self._own_store = tempfile.mkdtemp(prefix="cpd-l3-", dir=base)
            kv_store = f"file://{self._own_store}"
        self.kv_store = kv_store
        try:
            self._start_workers(kv_store, timeout_s)
            self._start_router(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _env(self) -> dict:
        env = dict(os.environ)
        env.update({k: str(v) for k, v in self.cfg.extra_env.items()})
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=log, text=True,
                             env=self._env(), preexec_fn=_die_with_parent)
        self.procs.append(p)
        return p

    def _start_workers(self, kv_store: str, timeout_s: float) -> None:
        roles = self.cfg.roles()
        threads = self.cfg.torch_threads or max(1, (os.cpu_count() or 1) // len(roles))
        counters: dict[str, int] = {}
        pending = []
        for role in roles:
            i = counters[role] = counters.get(role, -1) + 1
            wid = f"{ROLE_PREFIX[role]}{i}"
            port, eport = free_port(), free_port()
            args = ["-m", "cpd.worker.main", "--role", role, "--worker-id", wid, "--model", self.cfg.model_dir,
                    "--host", self.cfg.host, "--port", str(port), "--events-port", str(eport),
                    "--kv-store", kv_store, "--num-blocks", str(self.cfg.num_blocks),
                    "--l3-chunk-blocks", str(self.cfg.l3_chunk_blocks),
                    "--block-size", str(self.cfg.block_size), "--host-kv-bytes", str(self.cfg.host_kv_bytes),
                    "--max-num-batched-tokens", str(self.cfg.max_num_batched_tokens),
                    "--max-prefill-chunk-tokens", str(self.cfg.max_prefill_chunk_tokens),
                    "--max-num-seqs", str(self.cfg.max_num_seqs), "--torch-threads", str(threads)]
            if self.cfg.handoff_force_tcp:
                args.append("--handoff-force-tcp")
            pending.append((wid, self._spawn(args, wid)))
        for wid, p in pending:
            info = _wait_ready(p, timeout_s, self.log_dir / f"{wid}.log")
            info["url"] = f"http://{self.cfg.host}:{info['port']}"
            info["events_endpoint"] = f"tcp://{self.cfg.host}:{info['events_port']}"
            info["pid"] = p.pid
            self.workers.append(info)
            self._worker_procs[wid] = p

    def _start_router(self, timeout_s: float) -> None:
        w0 = self.workers[0]
        for w in self.workers[1:]:
            if w["namespace"] != w0["namespace"]:
                raise DeploymentError(f"workers disagree on the KV namespace: {w0['namespace']} vs {w['namespace']}")
        rcfg = {"workers": [{k: w[k] for k in ("worker_id", "role", "url", "events_endpoint")} for w in self.workers],
                "namespace": w0["namespace"], "tokenizer_dir": self.cfg.model_dir,
                "model_name": self.cfg.model_name or w0["model_name"], "max_model_len": w0["max_model_len"],
                "kv_bytes_per_token": w0["kv_bytes_per_token"], "topology": self.cfg.topology,
                "cold_threshold": self.cfg.cold_threshold, "max_in_flight": self.cfg.max_in_flight,
                "max_decode_per_worker": self.cfg.max_decode_per_worker or 2 * self.cfg.max_num_seqs,
                "host": self.cfg.host, "port": self.port}
        path = Path(self._tmp) / "router.json"
        path.write_text(json.dumps(rcfg))
        self.router_proc = self._spawn(["-m", "cpd.router.main", "--config", str(path)], "router")
        self.model_name = rcfg["model_name"]
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.router_proc.poll() is not None:
                raise DeploymentError(f"router exited; see {self.log_dir / 'router.log'}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise DeploymentError("router did not become healthy")

    def stop(self) -> None:
        """Stop the router first, then workers (SIGTERM, SIGKILL after 10 s)."""
        order = ([self.router_proc] if self.router_proc else []) + [p for p in self.procs if p is not self.router_proc]
        for p in order:
            if p.poll() is None:
                p.terminate()
        for p in order:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            if p.stdout:
                p.stdout.close()
        self.procs.clear()
        if self._own_store:
            shutil.rmtree(self._own_store, ignore_errors=True)
            self._own_store = None

    def __enter__(self) -> "Deployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- helpers for tests and the demo -------------------------------------------------
    def alive_workers(self) -> list[dict]:
        return [w for w in self.workers if self._worker_procs[w["worker_id"]].poll() is None]

    def kill_worker(self, worker_id: str) -> None:
        """SIGKILL one worker (fault injection in tests)."""
        p = self._worker_procs[worker_id]
        p.kill()
        p.wait(10)

    def worker_urls(self, role: str | None = None) -> list[str]:
        return [w["url"] for w in self.alive_workers() if role is None or w["role"] == role]

    def pool_stats(self) -> dict[str, dict]:
        """Each live worker's block-pool accounting (``GET /load``)."""
        return {w["worker_id"]: httpx.get(f"{w['url']}/load", timeout=5).json()["pool"]
                for w in self.alive_workers()}

    def reset_prefix_caches(self) -> None:
        """Clear every worker's L1 and L2 (the L3 store is untouched)."""
        for u in self.worker_urls():
            httpx.post(f"{u}/reset_prefix_cache", timeout=10).raise_for_status()


def _wait_ready(p: subprocess.Popen, timeout_s: float, log_path: Path) -> dict:
    result: dict = {}
    ready = threading.Event()

    def read():  # keeps draining stdout after READY so the child never blocks on a full pipe
        for line in p.stdout:
            if line.startswith("READY ") and not ready.is_set():
                result.update(json.loads(line[6:]))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(timeout_s)
    if not result:
        tail = log_path.read_text()[-3000:] if log_path.exists() else ""
        raise DeploymentError(f"worker did not start (exit={p.poll()}):\n{tail}")
    return result

