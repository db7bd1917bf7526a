"""Entry point of one worker process: ``python -m cpd.worker.main --role ROLE --worker-id ID
--port P --events-port E [--config FILE] [flags]``.

Started by ``cpd serve`` (one process per worker, all reading the deployment's one config
file, :mod:`cpd.config`). Prints ``READY <json>`` on stdout
once the engine is loaded and the HTTP server listens.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from dataclasses import dataclass

import uvicorn

from cpd.log_level import configure_logging
from cpd.config import FLAGS, Config, ConfigError, argparse_overrides, add_argparse_flags, build_config, parse_assignments

from cpd.worker.runtime import EngineRunner, StepHealth
from cpd.worker.server import WorkerState, build_app, worker_info

log = logging.getLogger("cpd.worker")


@dataclass(frozen=True)
class WorkerIdentity:
    """What only this process has: its role, id and listen addresses (not configuration)."""

    role: str
    worker_id: str
    host: str
    port: int
    events_port: int
    router_url: str = ""  # register with this router (cpd.worker.registration); "" = static list
    advertise_host: str = ""  # address others reach this worker at ("" = host)

    @property
    def reach_host(self) -> str:
        return self.advertise_host or self.host

    def registration(self) -> dict:
        """What this worker registers with its router."""
        return {"worker_id": self.worker_id, "role": self.role, "url": f"http://{self.reach_host}:{self.port}",
                "events_endpoint": f"tcp://{self.reach_host}:{self.events_port}"}


def parse_args(argv: list[str] | None = None) -> tuple[WorkerIdentity, Config]:
    """Identity flags, then the configuration: ``--config FILE``, ``--set KEY=VALUE`` and the
    engine/KV/handoff flags of :data:`cpd.config.FLAGS` (unset flags leave the file's value).

    Exits with status 2 and a message naming the key on an invalid configuration."""
    p = argparse.ArgumentParser(description="cpd worker process")
    p.add_argument("--role", required=True, choices=["pre-prefill", "prefill", "decode"])
    p.add_argument("--worker-id", default="", help="unique name (default: ROLE-HOSTNAME-PORT)")
    p.add_argument("--host", default="127.0.0.1", help="listen address of this worker")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--events-port", type=int, default=0, help="KV event publisher port (0 = --port + 1)")
    p.add_argument("--router", default="", help="router URL to register with (re-registers periodically)")
    p.add_argument("--advertise-host", default="", help="address the router and decode workers reach this "
                                                         "worker at (default: --host)")
    p.add_argument("--config", default=None, help="config file (.toml, .yaml, .json); see cpd config show")
    p.add_argument("--set", dest="set_", action="append", default=[], metavar="SECTION.KEY=VALUE")
    worker_flags = [f for f in FLAGS if f.worker]
    add_argparse_flags(p, worker_flags)
    a = p.parse_args(argv)
    overrides = argparse_overrides(a, worker_flags)
    try:
        overrides.update(parse_assignments(a.set_))
        cfg = build_config(a.config, overrides)
    except ConfigError as e:
        p.error(str(e))
    if not cfg.model.dir:
        p.error("model.dir is empty: pass --model DIR or set [model] dir in the config file")
    wid = a.worker_id or f"{a.role}-{socket.gethostname()}-{a.port}"
    return WorkerIdentity(a.role, wid, a.host, a.port, a.events_port or a.port + 1, a.router,
                          a.advertise_host), cfg


def _executor(cfg: Config):
    """The modeled executor (never imports torch), or None for the torch one (torch threads set)."""
    e = cfg.engine
    if e.executor == "modeled":
        from cpd.engine.executor_modeled import build_modeled_executor
        return build_modeled_executor(e.model_shape, e.hardware, e.tp, time_dilation=e.time_dilation,
                                      payload_fraction=e.kv_payload_fraction, served_model_dir=cfg.model.dir)
    if e.torch_threads:
        import torch
        torch.set_num_threads(e.torch_threads)
    return None


def _torch_dtype(cfg: Config, executor):
    """The torch executor's dtype from ``engine.dtype`` (None for the modeled executor)."""
    if executor is not None:
        return None
    from cpd.engine.dtype import resolve_dtype
    try:
        return resolve_dtype(cfg.engine.dtype)
    except ValueError as e:  # e.g. float16 on a CPU: this host cannot run it; say so, not a traceback
        raise SystemExit(f"cpd worker: error: engine.dtype {cfg.engine.dtype}: {e}") from None


def _event_publisher(publisher_class, endpoint: str):
    import zmq

    try:
        return publisher_class(endpoint)
    except zmq.ZMQError as e:  # e.g. another worker's --events-port (default: --port + 1)
        raise SystemExit(f"cpd worker: error: cannot publish KV events on {endpoint}: {e}; "
                         "choose another --events-port") from None


def build_state(me: WorkerIdentity, cfg: Config) -> WorkerState:
    from cpd.engine.engine import Engine
    from cpd.engine.faults import FaultPlan
    from cpd.engine.scheduler import SchedulerConfig
    from cpd.kv.event_bus import EventPublisher

    executor = _executor(cfg)
    dtype = _torch_dtype(cfg, executor)
    publisher = _event_publisher(EventPublisher, f"tcp://{me.host}:{me.events_port}")
    connector = _l3_connector(me, cfg, publisher)
    e = cfg.engine
    sched = SchedulerConfig(max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs,
                            max_prefill_chunk_tokens=e.max_prefill_chunk_tokens, block_size=e.block_size)
    engine = Engine(cfg.model.dir, num_blocks=e.num_blocks, block_size=e.block_size,
                    host_kv_bytes=cfg.kv.host_kv_bytes, swap_space_bytes=cfg.kv.swap_space_bytes,
                    scheduler_config=sched, connector=connector,
                    event_sink=publisher.emit, executor=executor, dtype=dtype,
                    batch_invariant=e.batch_invariant,
                    faults=FaultPlan.from_env(worker_id=me.worker_id))  # test-only CPD_FAULT_* variables
    sender = receiver = None
    from cpd.worker.handoff import HandoffReceiver, HandoffSender
    if me.role == "decode":
        receiver = HandoffReceiver(force_tcp=cfg.handoff.force_tcp, secret=cfg.auth.secret())
    else:
        sender = HandoffSender(arena_bytes=cfg.handoff.arena_bytes, bind_host=me.host,
                               advertise_host=me.advertise_host or None,
                               reclaim_after_s=cfg.handoff.reclaim_after_s, secret=cfg.auth.secret())
    runner = EngineRunner(engine, publisher, StepHealth(retry_after_s=e.failed_steps_retry_after_s),
                          max_step_s=e.max_step_s)
    return WorkerState(me.role, me.worker_id, engine, runner, sender, receiver, publisher, connector)


def _l3_connector(me: WorkerIdentity, cfg: Config, publisher):
    """The L3 connector of a prefill-side worker with a store; None otherwise."""
    if not cfg.kv.l3_url or me.role == "decode":
        return None
    from cpd.store import open_store
    from cpd.store.connector import L3Connector
    store = open_store(cfg.kv.l3_url, chunk_blocks=cfg.kv.l3_chunk_blocks or None,
                       capacity_bytes=cfg.kv.l3_capacity_bytes)
    return L3Connector(store, event_sink=publisher.emit, on_written=publisher.flush)


def secure_app(app, st: WorkerState, auth):
    """With an internal secret (``auth.internal_secret_file`` or ``$CPD_INTERNAL_SECRET``): every
    endpoint but ``/health`` needs a signed request (401/403 otherwise, :mod:`cpd.auth`), and this
    worker signs its own calls (handoff release at the sender)."""
    secret = auth.secret()
    if secret:
        import httpx

        from cpd.auth import SignedRequestMiddleware, client_auth
        st.http = httpx.AsyncClient(timeout=10.0, auth=client_auth(secret))
        app.add_middleware(SignedRequestMiddleware, secret=secret, open_paths=("/health",),
                           max_skew_s=auth.max_skew_s)
    return app


def _model_name(cfg: Config) -> str:
    """Served model id: ``model.name``, else the directory's last path part."""
    return cfg.model.name or os.path.basename(os.path.normpath(cfg.model.dir))


def _bound_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # in use (another worker's --port), or not an address of this host
        sock.close()
        raise SystemExit(f"cpd worker: error: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(argv: list[str] | None = None) -> None:
    me, cfg = parse_args(argv)
    configure_logging("cpd worker")
    sock = _bound_socket(me.host, me.port)  # before the model loads: a port in use fails at once
    try:
        st = build_state(me, cfg)
    except FileNotFoundError as e:  # no model (or a file it names) where the configuration points
        raise SystemExit(f"cpd worker: error: {e}") from None
    app = secure_app(build_app(st), st, cfg.auth)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    st.model_name = _model_name(cfg)
    ready = {**worker_info(st), "port": me.port, "events_port": me.events_port}
    print("READY " + json.dumps(ready), flush=True)
    registrar = None
    if me.router_url:
        from cpd.worker.registration import Registrar
        registrar = Registrar(me.router_url, me.registration(), cfg.auth.secret()).start()
        st.on_role_change.append(registrar.set_role)  # re-registrations report the current role
    try:
        server.run(sockets=[sock])
    finally:
        if registrar is not None:
            registrar.close()
        st.runner.close()
        if st.connector is not None and hasattr(st.connector, "close"):
            st.connector.close()
        if st.sender is not None:
            st.sender.close()
        st.publisher.close()


if __name__ == "__main__":
    main()
