"""Entry point of the router process: ``python -m cpd.router.main --config FILE [--set KEY=VALUE]``.

The config file is the deployment's configuration tree (:mod:`cpd.config`; :mod:`cpd.deploy`
writes it, or write it by hand): ``[router]`` gives the listen address, routing and admission
settings, the call bounds (``[router.timeouts]``; the ``CPD_DISPATCH_TIMEOUTS`` environment
variable, a JSON object, still overrides them), the ``workers`` to route to and ``served``: the
KV namespace, ``max_model_len`` and ``kv_bytes_per_token`` the workers reported. ``[model]``
gives the tokenizer directory and served model id, ``[deployment] topology`` the pools. The routing
settings (``router.routing_mode``, ``write_through``, SLOs, admission, decode-local append,
read-after-write, ``elastic`` + ``planner``) become one :class:`cpd.policy.routing.RoutingConfig`
(:func:`cpd.config.routing_config`); ``cpd router`` takes their flags (``--routing-mode``,
``--write-through``, ``--ttft-slo``, ``--elastic``, ...: the :data:`cpd.config.FLAGS` marked ``router``).
Workers whose namespace or context differs from ``served`` are refused at run time
(:mod:`cpd.router.compat`), not at startup: the router starts and serves with the compatible ones.
"""
from __future__ import annotations

import argparse
import os

import uvicorn
from fastapi import FastAPI

from cpd.log_level import configure_logging
from cpd.config import (FLAGS, Config, ConfigError, add_argparse_flags, argparse_overrides, build_config,
                        parse_assignments, routing_config)
from cpd.kv.block_hash import Namespace
from cpd.router.api_keys import ApiKeys
from cpd.router.app import Router
from cpd.router.timeouts import DispatchTimeouts
from cpd.router.workers import WorkerInfo


def build_router(cfg: Config) -> Router:
    """The router of a configuration.

    Raises:
        ConfigError: ``router.served`` or ``router.workers`` missing, or no model directory."""
    r = cfg.router
    if r.served is None or not cfg.model.dir:
        raise ConfigError("the router needs router.served (namespace, max_model_len, kv_bytes_per_token: "
                          "what the workers report in their READY line and GET /info) and model.dir "
                          "(the tokenizer); cpd serve writes them, see cpd.deploy; router.workers may be "
                          "empty when workers register (cpd worker --router URL)")
    workers = [WorkerInfo(w.worker_id, w.role, w.url, w.events_endpoint) for w in r.workers]
    timeouts = DispatchTimeouts.from_env() if os.environ.get("CPD_DISPATCH_TIMEOUTS") else r.timeouts
    model_name = cfg.model.name or os.path.basename(os.path.normpath(cfg.model.dir))
    try:
        api_keys = ApiKeys.build(cfg.auth.api_keys, cfg.auth.api_key_files)
        secret = cfg.auth.secret()
    except (OSError, ValueError) as e:
        raise ConfigError(f"auth: {e}") from None
    return Router(workers, Namespace(**r.served.namespace), cfg.model.dir, model_name, r.served.max_model_len,
                  r.served.kv_bytes_per_token,
                  routing=routing_config(cfg),
                  elastic=r.planner if r.elastic else None, role_window_s=r.role_window_s,
                  raw_ready_margin_s=r.raw_ready_margin_s, prefill_cost_fit=r.prefill_cost_fit,
                  queue_remaining=r.queue_remaining,
                  max_in_flight=r.max_in_flight, max_decode_per_worker=r.decode_slots(cfg.engine.max_num_seqs),
                  max_request_body_bytes=r.max_request_body_bytes, api_keys=api_keys,
                  open_paths=tuple(cfg.auth.open_paths), internal_secret=secret, timeouts=timeouts,
                  background_stall_timeout_s=r.background_stall_timeout_s)


def _serve_supervisor_status(app: FastAPI, router: Router, status_path: str) -> None:
    """``GET /cpd/processes``: the launcher's supervisor status (pid, alive, ready, restarts per
    process); the same figures are metrics (``cpd_process_restarts_total``, ``cpd_process_up``)."""
    from cpd.supervise import read_status
    router.metrics.watch_supervisor(status_path)

    @app.get("/cpd/processes")
    async def processes() -> dict:
        return read_status(status_path).get("processes", {})


def _add_standalone_flags(p: argparse.ArgumentParser) -> None:
    """Flags of ``cpd router`` (they override the config file)."""
    p.add_argument("--host", default=None, help="listen address (key router.host)")
    p.add_argument("--port", type=int, default=None, help="listen port (key router.port)")
    p.add_argument("--model", default=None, help="model directory: tokenizer and served name (key model.dir)")
    p.add_argument("--api-key", action="append", default=[], help="accepted client key (repeatable)")
    p.add_argument("--api-key-file", action="append", default=[], help="file of 'KEY [TENANT]' lines")
    p.add_argument("--served-from", default="", help="a worker URL to learn the KV namespace from when "
                                                     "router.served is not set (default: the static workers)")


def _standalone_overrides(a: argparse.Namespace) -> dict:
    out: dict = {k: v for k, v in (("router.host", a.host), ("router.port", a.port), ("model.dir", a.model))
                 if v is not None}
    if a.api_key:
        out["auth.api_keys"] = a.api_key
    if a.api_key_file:
        out["auth.api_key_files"] = a.api_key_file
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="cpd router")
    p.add_argument("--config", default=None, help="config file (.toml, .yaml, .json); see cpd config show")
    p.add_argument("--set", dest="set_", action="append", default=[], metavar="SECTION.KEY=VALUE")
    _add_standalone_flags(p)
    router_flags = [f for f in FLAGS if f.router]
    add_argparse_flags(p, router_flags)
    a = p.parse_args(argv)
    configure_logging("cpd router")
    try:
        cfg = build_config(a.config, {**_standalone_overrides(a), **argparse_overrides(a, router_flags),
                                      **parse_assignments(a.set_)})
        if cfg.router.served is None:
            from cpd.router.bootstrap import learn_served
            cfg.router.served = learn_served(cfg, a.served_from, cfg.auth.secret())
        router = build_router(cfg)
    except ConfigError as e:
        p.error(str(e))
    app = router.app()
    if cfg.router.supervisor_status:
        _serve_supervisor_status(app, router, cfg.router.supervisor_status)
    uvicorn.run(app, host=cfg.router.host, port=cfg.router.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
