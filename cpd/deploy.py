"""Start and stop a whole CPD deployment on one host: worker processes + router process.

Used by ``cpd serve``, ``make demo`` and the tests. What to start is a :class:`cpd.config.Config`
(sections ``deployment`` for the pools and supervision, ``engine``/``kv``/``handoff`` for the
workers, ``router``); the launcher writes it to ``workers.toml`` (every worker reads it with
``--config``) and, completed with the workers' endpoints and reported KV namespace, to
``router.toml`` for the router. Every process is a child that
dies with its parent (``PR_SET_PDEATHSIG`` on Linux), so no orphans are left even if
the launcher is killed; children run in their own session, so a terminal's Ctrl-C reaches
only the launcher, which stops them in order (router first, then workers).

With ``deployment.supervise`` (the default) a child that exits is restarted with the
same command line and ports, with exponential backoff (:mod:`cpd.supervise`); so is a
worker that fails its ``/health`` probes for ``deployment.liveness_timeout_s`` (engine
stuck, no answer: :mod:`cpd.liveness`) or reports ``deployment.liveness_max_failed_steps``
consecutive failed engine steps, and a router whose ``/health`` does not answer, or answers 503
``background_stalled`` (a background task of the router died or stalled:
:mod:`cpd.router.background`), for ``liveness_timeout_s``, killed first. A restarted router rebuilds its view at start-up as it
built it the first time: the workers from ``router.toml`` (a role changed at run time is adopted
from the worker's ``/info``), their L1/L2 blocks from ``/kv_snapshot`` and the L3 view from a
store listing; only :meth:`Deployment.stop` ends the deployment. Restarts are logged and counted in
``<log_dir>/supervisor.json``, which the router exports as metrics.
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import httpx

from cpd.config import Config, ServedModel, WorkerEndpoint
from cpd.config import write as write_config
from cpd.liveness import LivenessPolicy, classify_answer
from cpd.policy.routing import max_cached_blocks
from cpd.supervise import Child, RestartPolicy, Supervisor, http_probe

log = logging.getLogger("cpd.deploy")

ROLE_PREFIX = {"pre-prefill": "pp", "prefill": "p", "decode": "d"}


_HANDED_OUT: deque[int] = deque(maxlen=4096)
"""Ports :func:`free_port` returned recently in this process: never returned again while here."""


def free_port() -> int:
    """A TCP port free now, for a child to bind later. Ports are checked and released one at a
    time, so without memory two calls could return the same port (a worker's HTTP and event
    ports, or two workers'), and the second bind fails with "Address already in use" (seen in
    CI-sized runs): a port handed out recently is never handed out again. Chosen outside the
    kernel's ephemeral range where that leaves room, so no outgoing connection takes it
    meanwhile (where it leaves none, the kernel's choice for port 0). Raises DeploymentError
    after 256 tries without a free, not recently handed out port."""
    lo, hi = _ephemeral_range()
    span = range(10000, lo) if lo - 10000 >= 1000 else range(hi + 1, 65536)
    rng = random.SystemRandom()
    for _ in range(256):
        port = rng.choice(span) if len(span) else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port
    raise DeploymentError("no free TCP port found")


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux), else the IANA one."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 49152, 65535


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class DeploymentError(RuntimeError):
    pass


class Deployment:
    """A running deployment. Use as a context manager or call start()/stop()."""

    def __init__(self, cfg: Config, log_dir: str | None = None, extra_env: dict[str, str] | None = None,
                 worker_extra_args: list[str] | None = None):
        """``cfg``: the deployment's configuration (``model.dir`` must be set). ``extra_env`` goes
        into every child's environment and ``worker_extra_args`` onto every worker's command line
        (tests: fault injection, secrets)."""
        if not cfg.model.dir:
            raise DeploymentError("model.dir is empty: set it (cpd serve resolves the default model)")
        self.cfg = cfg
        self.extra_env = dict(extra_env or {})
        self.worker_extra_args = [str(x) for x in worker_extra_args or []]
        self.workers: list[dict] = []  # READY info per worker (+ url, events_endpoint, pid)
        self.children: dict[str, Child] = {}  # worker id or "router" -> its process record
        self.host = cfg.router.host
        self.port = cfg.router.port or free_port()
        self.url = f"http://{self.host}:{self.port}"
        self._own_store: str | None = None
        self._tmp = tempfile.mkdtemp(prefix="cpd-deploy-")
        self.log_dir = Path(log_dir or cfg.deployment.log_dir or self._tmp)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.status_path = self.log_dir / "supervisor.json"
        self.supervisor: Supervisor | None = None
        self.model_name = ""

    @property
    def model_dir(self) -> str:
        return self.cfg.model.dir

    # --- lifecycle -----------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> "Deployment":
        kv_store = self.cfg.kv.l3_url
        if not kv_store:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            self._own_store = tempfile.mkdtemp(prefix="cpd-l3-", dir=base)
            kv_store = f"file://{self._own_store}"
        self.kv_store = kv_store
        try:
            self.worker_config_path = self._write_worker_config(kv_store)
            self._start_workers(timeout_s)
            self._start_router(timeout_s)
            self._start_supervisor()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def procs(self) -> list[subprocess.Popen]:
        """The current process of every child (router included)."""
        return [c.proc for c in self.children.values() if c.proc is not None]

    @property
    def router_proc(self) -> subprocess.Popen | None:
        c = self.children.get("router")
        return c.proc if c else None

    def _env(self) -> dict:
        env = dict(os.environ)
        env.update({k: str(v) for k, v in self.extra_env.items()})
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def internal_client_auth(self):
        """``auth=`` for httpx calls to the workers' internal endpoints (signed when a secret is
        set: ``auth.internal_secret_file``, else ``$CPD_INTERNAL_SECRET`` of the children)."""
        from cpd.auth import client_auth, load_secret
        return client_auth(load_secret(self.cfg.auth.internal_secret_file or None, env=self._env()))

    def _log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _spawner(self, args: list[str], name: str, stdout_pipe: bool = True):
        """A function that starts this child (first start truncates its log, restarts append).
        Workers' stdout is a pipe (their READY line); the router's goes to its log."""
        first = {"start": True}

        def spawn() -> subprocess.Popen:
            log_file = open(self._log_path(name), "w" if first["start"] else "a")
            first["start"] = False
            try:
                return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE if stdout_pipe else log_file,
                                        stderr=log_file, text=True, env=self._env(), preexec_fn=_die_with_parent,
                                        start_new_session=True)
            finally:
                log_file.close()  # the child holds its own descriptor
        return spawn

    def _write_worker_config(self, kv_store: str) -> Path:
        """The configuration every worker reads (``--config``): this deployment's, with its store."""
        wcfg = self.cfg.model_copy(deep=True)
        wcfg.kv.l3_url = kv_store
        return write_config(wcfg, Path(self._tmp) / "workers.toml")

    def _worker_args(self, role: str, wid: str, threads: int) -> list[str]:
        port, eport = free_port(), free_port()
        return ["-m", "cpd.worker.main", "--role", role, "--worker-id", wid, "--host", self.host,
                "--port", str(port), "--events-port", str(eport), "--config", str(self.worker_config_path),
                "--torch-threads", str(threads), *self.worker_extra_args]

    def _start_workers(self, timeout_s: float) -> None:
        roles = self.cfg.deployment.roles()
        threads = self.cfg.engine.torch_threads or max(1, (os.cpu_count() or 1) // len(roles))
        counters: dict[str, int] = {}
        pending = []
        for role in roles:
            i = counters[role] = counters.get(role, -1) + 1
            wid = f"{ROLE_PREFIX[role]}{i}"
            c = Child(wid, role, self._spawner(self._worker_args(role, wid, threads), wid),
                      on_started=self._watch_worker_ready)
            c.proc = c.spawn()
            c.started_at_s = time.monotonic()
            self.children[wid] = c
            pending.append(c)
        for c in pending:
            proc = _running(c)
            info = _wait_ready(proc, timeout_s, self._log_path(c.name))
            info["url"] = f"http://{self.host}:{info['port']}"
            info["events_endpoint"] = f"tcp://{self.host}:{info['events_port']}"
            info["pid"] = proc.pid
            c.health_url = f"{info['url']}/health"  # same port after a restart
            c.ready.set()
            self.workers.append(info)

    def _watch_worker_ready(self, c: Child) -> None:
        """After a restart: wait (in a thread) for the worker's READY line, then mark it ready."""
        proc = _running(c)

        def wait() -> None:
            try:
                info = _wait_ready(proc, self.cfg.deployment.restart_ready_timeout_s, self._log_path(c.name))
            except DeploymentError as e:
                log.warning("restarted %s did not become ready: %s", c.name, str(e).splitlines()[0])
                return
            w = next(w for w in self.workers if w["worker_id"] == c.name)
            if info.get("namespace") != w["namespace"]:
                log.error("restarted %s reports another KV namespace; stopping it", c.name)
                proc.kill()
                return
            w["pid"] = proc.pid
            if c.proc is proc:
                c.ready.set()
                log.warning("%s is ready again (pid %d)", c.name, proc.pid)
                if self.supervisor is not None:
                    self.supervisor.write_status()
        threading.Thread(target=wait, name=f"ready-{c.name}", daemon=True).start()

    def _watch_router_ready(self, c: Child) -> None:
        """After a restart: the router is ready once it answers ``/health`` (any status)."""
        proc = _running(c)

        def wait() -> None:
            deadline = time.monotonic() + self.cfg.deployment.restart_ready_timeout_s
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    httpx.get(f"{self.url}/health", timeout=1.0)
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                if c.proc is proc:
                    c.ready.set()
                    log.warning("router is ready again (pid %d)", proc.pid)
                    if self.supervisor is not None:
                        self.supervisor.write_status()
                return
        threading.Thread(target=wait, name="ready-router", daemon=True).start()

    def _router_config(self, w0: dict) -> Config:
        """This deployment's configuration plus what the router learns from the workers: their
        endpoints and the KV namespace/context they reported (``router.workers``, ``router.served``)."""
        rcfg = self.cfg.model_copy(deep=True)
        rcfg.model.name = self.cfg.model.name or w0["model_name"]
        rcfg.kv.l3_url = self.kv_store
        rcfg.router.port = self.port
        rcfg.router.supervisor_status = str(self.status_path)
        rcfg.router.workers = [WorkerEndpoint(**{k: w[k] for k in ("worker_id", "role", "url", "events_endpoint")})
                               for w in self.workers]
        rcfg.router.served = ServedModel(namespace=w0["namespace"], max_model_len=w0["max_model_len"],
                                         kv_bytes_per_token=w0["kv_bytes_per_token"])
        return rcfg

    def _start_router(self, timeout_s: float) -> None:
        w0 = self.workers[0]
        for w in self.workers[1:]:
            if w["namespace"] != w0["namespace"]:
                raise DeploymentError(f"workers disagree on the KV namespace: {w0['namespace']} vs {w['namespace']}")
        path = write_config(self._router_config(w0), Path(self._tmp) / "router.toml")
        c = Child("router", "router", self._spawner(["-m", "cpd.router.main", "--config", str(path)], "router",
                                            stdout_pipe=False),
                  on_started=self._watch_router_ready, health_url=f"{self.url}/health",
                  classify=classify_answer)  # alive if it answers, unless 503 background_stalled
        c.proc = c.spawn()
        c.started_at_s = time.monotonic()
        self.children["router"] = c
        self.model_name = self.cfg.model.name or w0["model_name"]
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if c.proc.poll() is not None:
                raise DeploymentError(f"router exited; see {self._log_path('router')}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    c.ready.set()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise DeploymentError("router did not become healthy")

    def _start_supervisor(self) -> None:
        """Write the status file; with ``supervise`` also start restarting exited children."""
        d = self.cfg.deployment
        policy = RestartPolicy(d.restart_backoff_s, d.restart_backoff_max_s, d.restart_stable_s)
        liveness = LivenessPolicy(d.liveness_timeout_s, d.liveness_probe_interval_s, d.liveness_probe_timeout_s,
                                  d.liveness_startup_grace_s, d.liveness_max_failed_steps)
        auth = self.internal_client_auth()  # /health is an open path by default; signed in case it is not
        self.supervisor = Supervisor(list(self.children.values()), policy, self.status_path,
                                     log_path=self._log_path, liveness=liveness,
                                     probe=lambda url, timeout_s: http_probe(url, timeout_s, auth=auth))
        if d.supervise:
            self.supervisor.start()
        else:
            self.supervisor.write_status()

    def stop(self) -> None:
        """Stop the router first, then workers (SIGTERM, SIGKILL after 10 s). Restarts end first."""
        if self.supervisor is not None:
            self.supervisor.pause()
        router = self.children.get("router")
        order = ([router] if router else []) + [c for c in self.children.values() if c is not router]
        procs = [c.proc for c in order if c.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            if p.stdout:
                p.stdout.close()
        if self.supervisor is not None:
            self.supervisor.close()  # after the children: they die with the thread that forked them
            self.supervisor.write_status()
        self.children.clear()
        if self._own_store:
            shutil.rmtree(self._own_store, ignore_errors=True)
            self._own_store = None

    def __enter__(self) -> "Deployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- helpers for tests and the demo -------------------------------------------------
    def alive_workers(self) -> list[dict]:
        """Workers whose process runs and has reported READY (a restarting one is left out)."""
        return [w for w in self.workers if self.children[w["worker_id"]].alive()
                and self.children[w["worker_id"]].ready.is_set()]

    def pids(self) -> dict[str, int]:
        """Current pid of every child: ``{"router": pid, "<worker id>": pid}``."""
        return {name: c.proc.pid for name, c in self.children.items() if c.proc is not None}

    def kill_worker(self, worker_id: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default SIGKILL) to one worker or the router (fault injection in tests)
        and wait for it to exit; returns the pid it had."""
        p = _running(self.children[worker_id])
        p.send_signal(sig)
        p.wait(10)
        return p.pid

    def kill_router(self, sig: int = signal.SIGKILL) -> int:
        return self.kill_worker("router", sig)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until every child runs and is ready and the router reports every worker healthy
        (after restarts). Raises DeploymentError on timeout."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if all(c.alive() and c.ready.is_set() for c in self.children.values()):
                try:
                    r = httpx.get(f"{self.url}/health", timeout=2.0)
                    if r.status_code == 200 and all(r.json().get("workers", {}).values()):
                        return
                    last = r.text
                except (httpx.HTTPError, ValueError) as e:
                    last = repr(e)
            time.sleep(0.2)
        raise DeploymentError(f"deployment not ready within {timeout_s} s: {last} {self.supervisor_status()}")

    def supervisor_status(self) -> dict:
        from cpd.supervise import read_status
        return read_status(self.status_path)

    def worker_urls(self, role: str | None = None) -> list[str]:
        return [w["url"] for w in self.alive_workers() if role is None or w["role"] == role]

    def pool_stats(self) -> dict[str, dict]:
        """Each live worker's block-pool accounting (``GET /load``)."""
        return {w["worker_id"]: httpx.get(f"{w['url']}/load", timeout=5, auth=self.internal_client_auth()).json()["pool"]
                for w in self.alive_workers()}

    def reset_prefix_caches(self, timeout_s: float = 10.0) -> None:
        """Clear every worker's L1 and L2 (the L3 store is untouched) and return once the router's
        prefix index holds no L1/L2 block. The index follows the workers' KV events
        asynchronously, so without the wait a request routed right after the reset is planned on
        blocks that are gone (the engine then falls back, but the plan is not what a caller of a
        reset expects). For an idle deployment: blocks of requests in flight would be re-indexed."""
        for u in self.worker_urls():
            httpx.post(f"{u}/reset_prefix_cache", timeout=10, auth=self.internal_client_auth()).raise_for_status()
        _poll(self.index_sizes, lambda sizes: not (sizes["L1"] or sizes["L2"]), timeout_s,
              "the router's index to hold no L1/L2 block after a reset")

    def index_sizes(self) -> dict[str, int]:
        """Blocks per tier in the router's prefix index (``GET /cpd/index``)."""
        r = httpx.get(f"{self.url}/cpd/index", timeout=5, headers=self._client_headers)
        r.raise_for_status()
        return {k: int(v) for k, v in r.json().items() if k in ("L1", "L2", "L3")}

    def index_match(self, prompt_token_ids: list[int], cache_salt: str | None = None,
                    api_key: str | None = None) -> dict:
        """The router's view of where the prompt's leading blocks are (``POST /cpd/index/match``),
        in the namespace of ``api_key``'s tenant (default: the first configured key's)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else self._client_headers
        r = httpx.post(f"{self.url}/cpd/index/match", timeout=10, headers=headers,
                       json={"prompt_token_ids": list(prompt_token_ids), "cache_salt": cache_salt})
        r.raise_for_status()
        return r.json()

    def wait_indexed(self, prompt_token_ids: list[int], tier: str, worker_id: str | None = None,
                     min_blocks: int | None = None, timeout_s: float = 15.0, api_key: str | None = None) -> dict:
        """Wait until the router's index shows ``min_blocks`` leading blocks of the prompt
        (default: the :func:`~cpd.policy.routing.max_cached_blocks` a request would load) in ``tier`` ("L1", "L2"
        or "L3"; L1/L2 on ``worker_id`` or any worker). KV events and L3 announcements reach the
        index asynchronously; this replaces sleeping for a guess. Returns the last match."""
        need = max_cached_blocks(len(prompt_token_ids), self.cfg.engine.block_size) if min_blocks is None \
            else min_blocks

        def held(m: dict) -> bool:
            n = m["l3"] if tier == "L3" else max(
                (n for w, n in m[tier.lower()].items() if worker_id in (None, w)), default=0)
            return n >= need

        return _poll(lambda: self.index_match(prompt_token_ids, api_key=api_key), held, timeout_s,
                     f"{need} blocks of the prompt in {tier}{' of ' + worker_id if worker_id else ''}")

    @functools.cached_property
    def _client_headers(self) -> dict[str, str]:
        """A client ``Authorization`` header with the first configured API key (none without keys);
        read once (the deployment's configuration does not change)."""
        keys = list(self.cfg.auth.api_keys)
        if not keys and self.cfg.auth.api_key_files:
            from cpd.router.api_keys import parse_key_file
            path = self.cfg.auth.api_key_files[0]
            keys = [k for k, _ in parse_key_file(Path(path).read_text(encoding="utf-8"), path)]
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def _poll(read, done, timeout_s: float, what: str):
    """``read()`` every 20 ms until ``done(value)``; returns that value, or raises
    :class:`DeploymentError` naming ``what`` and the last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        if time.monotonic() > deadline:
            raise DeploymentError(f"waited {timeout_s} s for {what}; last seen: {value}")
        time.sleep(0.02)
    return value


def _running(c: Child) -> subprocess.Popen:
    """The process of a child that was spawned."""
    if c.proc is None:
        raise DeploymentError(f"{c.name} was never started")
    return c.proc


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

