"""Entry point of one worker process: ``python -m cpd.worker.main --role ROLE ...``.

Started by ``cpd serve`` (one process per worker). Prints ``READY <json>`` on stdout
once the engine is loaded and the HTTP server listens.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket

import uvicorn

from cpd.worker.runtime import EngineRunner
from cpd.worker.server import WorkerState, build_app, worker_info

log = logging.getLogger("cpd.worker")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="cpd worker process")
    p.add_argument("--role", required=True, choices=["pre-prefill", "prefill", "decode"])
    p.add_argument("--worker-id", required=True)
    p.add_argument("--model", required=True, help="HF Llama-family model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--events-port", type=int, required=True)
    p.add_argument("--kv-store", default="", help="L3 store URL (file://DIR or redis://HOST:PORT); empty = none")
    p.add_argument("--l3-chunk-blocks", type=int, default=0,
                   help="blocks per L3 value; 0 = the URL's chunk_blocks or 1 (processes sharing a store must agree)")
    p.add_argument("--l3-capacity-bytes", default="",
                   help="L3 store capacity (bytes, or 512M/2G; 0 = unlimited); empty = the URL's "
                        "capacity_bytes, else a default sized from the machine (cpd.store.capacity)")
    p.add_argument("--num-blocks", type=int, default=1024, help="L1 KV blocks")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--host-kv-bytes", type=int, default=256 << 20, help="L2 host pool size in bytes")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-prefill-chunk-tokens", type=int, default=512)
    p.add_argument("--handoff-arena-bytes", type=int, default=256 << 20)
    p.add_argument("--handoff-reclaim-after-s", type=float, default=120.0,
                   help="prefill side: free a handoff staging nobody released after this many seconds")
    p.add_argument("--handoff-force-tcp", action="store_true",
                   help="decode side: fetch KV over TCP even from a same-host sender (the cross-host path)")
    p.add_argument("--torch-threads", type=int, default=0, help="0 = torch default")
    return p.parse_args(argv)


def build_state(a: argparse.Namespace) -> WorkerState:
    import torch

    from cpd.engine.engine import Engine
    from cpd.engine.faults import FaultPlan
    from cpd.engine.scheduler import SchedulerConfig
    from cpd.kv.event_bus import EventPublisher

    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    publisher = EventPublisher(f"tcp://{a.host}:{a.events_port}")
    connector = None
    if a.kv_store and a.role != "decode":
        from cpd.store import open_store
        from cpd.store.connector import L3Connector
        from cpd.store import parse_size
        cap = parse_size(a.l3_capacity_bytes) if a.l3_capacity_bytes else None
        connector = L3Connector(open_store(a.kv_store, chunk_blocks=a.l3_chunk_blocks or None, capacity_bytes=cap),
                                event_sink=publisher.emit)
    sched = SchedulerConfig(max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                            max_prefill_chunk_tokens=a.max_prefill_chunk_tokens, block_size=a.block_size)
    engine = Engine(a.model, num_blocks=a.num_blocks, block_size=a.block_size, host_kv_bytes=a.host_kv_bytes,
                    scheduler_config=sched, connector=connector, event_sink=publisher.emit,
                    faults=FaultPlan.from_env())  # test-only CPD_FAULT_* variables; none in production
    sender = receiver = None
    from cpd.worker.handoff import HandoffReceiver, HandoffSender
    if a.role == "decode":
        receiver = HandoffReceiver(force_tcp=a.handoff_force_tcp)
    else:
        sender = HandoffSender(arena_bytes=a.handoff_arena_bytes, bind_host=a.host,
                               reclaim_after_s=a.handoff_reclaim_after_s)
    runner = EngineRunner(engine, publisher)
    return WorkerState(a.role, a.worker_id, engine, runner, sender, receiver, publisher, connector)


def _model_name(model_dir: str) -> str:
    """Served model id: ``name_or_path`` style name from the directory (last path part)."""
    return os.path.basename(os.path.normpath(model_dir))


def main(argv=None) -> None:
    a = parse_args(argv)
    logging.basicConfig(level=os.environ.get("CPD_LOG_LEVEL", "WARNING"))
    st = build_state(a)
    app = build_app(st)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    st.model_name = _model_name(a.model)
    ready = {**worker_info(st), "port": a.port, "events_port": a.events_port}
    print("READY " + json.dumps(ready), flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        st.runner.close()
        if st.connector is not None and hasattr(st.connector, "close"):
            st.connector.close()
        if st.sender is not None:
            st.sender.close()
        st.publisher.close()


if __name__ == "__main__":
    main()
