"""Entry point of the router process: ``python -m cpd.router.main --config router.json``.

The config (written by :mod:`cpd.deploy`, or by hand) lists workers, the KV namespace they
reported, ``max_model_len``, the tokenizer directory, topology and listen address; optional:
``max_request_body_bytes`` (default 16 MiB; larger bodies get 413). Workers whose namespace
or context differs from the config's are refused at run time (:mod:`cpd.router.compat`), not
at startup: the router starts and serves with the compatible ones.
"""
from __future__ import annotations

import argparse
import json
import logging
import os

import uvicorn

from cpd.kv.block_hash import Namespace
from cpd.router.app import Router
from cpd.router.request_body import DEFAULT_MAX_REQUEST_BODY_BYTES
from cpd.router.workers import WorkerInfo


def build_router(cfg: dict) -> Router:
    workers = [WorkerInfo(w["worker_id"], w["role"], w["url"], w["events_endpoint"]) for w in cfg["workers"]]
    return Router(workers, Namespace(**cfg["namespace"]), cfg["tokenizer_dir"], cfg["model_name"],
                  cfg["max_model_len"], cfg["kv_bytes_per_token"], topology=cfg.get("topology", "cpd"),
                  cold_threshold=cfg.get("cold_threshold", 0.5), max_in_flight=cfg.get("max_in_flight", 256),
                  max_decode_per_worker=cfg.get("max_decode_per_worker", 64),
                  max_request_body_bytes=cfg.get("max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES))


def _serve_supervisor_status(app, router: Router, status_path: str) -> None:
    """``GET /cpd/processes``: the launcher's supervisor status (pid, alive, ready, restarts per
    process); the same figures are metrics (``cpd_process_restarts_total``, ``cpd_process_up``)."""
    from cpd.supervise import read_status
    router.metrics.watch_supervisor(status_path)

    @app.get("/cpd/processes")
    async def processes():
        return read_status(status_path).get("processes", {})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="cpd router")
    p.add_argument("--config", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("CPD_LOG_LEVEL", "WARNING"))
    cfg = json.loads(open(a.config).read())
    router = build_router(cfg)
    app = router.app()
    if cfg.get("supervisor_status"):
        _serve_supervisor_status(app, router, cfg["supervisor_status"])
    uvicorn.run(app, host=cfg["host"], port=cfg["port"], log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
