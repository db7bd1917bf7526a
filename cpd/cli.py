"""The ``cpd`` command: serve, bench, simulate, analyze, demo."""
from __future__ import annotations

import signal
import time
from typing import Optional

import typer

app = typer.Typer(help="cpd: cache-aware prefill-decode disaggregation for LLM serving.",
                  no_args_is_help=True, add_completion=False)


def _resolve_model(model: Optional[str]) -> str:
    if model:
        return model
    from cpd.engine.weights import default_model_dir
    return str(default_model_dir())


@app.command()
def serve(
    topology: str = typer.Option("cpd", help="cpd (pre-prefill + prefill + decode) or pd (prefill + decode)"),
    pre_prefill: Optional[int] = typer.Option(None, "--pre-prefill", help="pre-prefill workers (cpd: default 1)"),
    prefill: Optional[int] = typer.Option(None, "--prefill", help="prefill workers (cpd: 1, pd: 2)"),
    decode: int = typer.Option(1, "--decode", help="decode workers"),
    model: Optional[str] = typer.Option(None, help="HF Llama-family directory (default: SmolLM2-135M-Instruct)"),
    kv_store: str = typer.Option("", help="L3 store: file:///dev/shm/DIR or redis://HOST:PORT (default: fresh file:// dir)"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    num_blocks: int = typer.Option(2048, help="L1 KV blocks per worker"),
    l3_chunk_blocks: int = typer.Option(0, help="blocks per L3 store value (0 = URL's chunk_blocks or 1)"),
    l3_capacity: str = typer.Option("", help="L3 store capacity, e.g. 8G (0 = unlimited; default: the URL's "
                                             "capacity_bytes, else sized from the machine, see cpd.store.capacity)"),
    block_size: int = typer.Option(16, help="tokens per KV block"),
    host_kv_bytes: int = typer.Option(512 << 20, help="L2 host KV pool bytes per worker"),
    cold_threshold: float = typer.Option(0.5, help="reuse ratio below which a request is cold"),
    max_num_batched_tokens: int = typer.Option(512, help="engine token budget per step"),
    log_dir: Optional[str] = typer.Option(None, help="where worker/router logs go"),
    torch_threads: int = typer.Option(0, help="torch threads per worker (0 = cores / workers)"),
    restart_backoff_s: float = typer.Option(1.0, help="first restart delay of a dead worker/router; doubles per "
                                                      "consecutive quick exit"),
    restart_backoff_max_s: float = typer.Option(30.0, help="cap of the restart delay"),
):
    """Run a CPD (or plain P/D) deployment until Ctrl-C (SIGINT) or SIGTERM.

    The launcher supervises its children: a worker or router that exits is restarted on the
    same ports with exponential backoff while the others keep serving (logged here and in
    LOG_DIR/<process>.log; counted in /metrics as cpd_process_restarts_total and listed at
    /cpd/processes). Only Ctrl-C/SIGTERM stops everything (router first, then workers)."""
    import logging

    from cpd.deploy import Deployment, DeploymentConfig

    if topology not in ("cpd", "pd"):
        raise typer.BadParameter("topology must be cpd or pd")
    cfg = DeploymentConfig(
        model_dir=_resolve_model(model), topology=topology,
        num_pre_prefill=(pre_prefill if pre_prefill is not None else 1) if topology == "cpd" else 0,
        num_prefill=prefill if prefill is not None else (1 if topology == "cpd" else 2),
        num_decode=decode, kv_store=kv_store, host=host, port=port, num_blocks=num_blocks, l3_chunk_blocks=l3_chunk_blocks, block_size=block_size,
        host_kv_bytes=host_kv_bytes, cold_threshold=cold_threshold, max_num_batched_tokens=max_num_batched_tokens,
        torch_threads=torch_threads, supervise=True, restart_backoff_s=restart_backoff_s,
        restart_backoff_max_s=restart_backoff_max_s,
        worker_extra_args=["--l3-capacity-bytes", l3_capacity] if l3_capacity else [])
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("cpd.deploy").setLevel(logging.INFO)
    stop = {"flag": False, "started": False}

    def on_signal(*_):
        stop["flag"] = True
        if not stop["started"]:  # still starting: unwind start(), which stops what it started
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job starts with it ignored
        signal.signal(sig, on_signal)
    dep = Deployment(cfg, log_dir=log_dir)
    typer.echo(f"starting {topology}: {', '.join(cfg.roles())} (model {cfg.model_dir})")
    try:
        dep.start()
        stop["started"] = True
        typer.echo(f"serving {dep.model_name} at {dep.url}/v1  (metrics {dep.url}/metrics, logs {dep.log_dir}); "
                   "Ctrl-C stops")
        while not stop["flag"]:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stop["started"] = True  # a second signal while stopping must not interrupt the stop
        dep.stop()
        typer.echo("stopped")


@app.command()
def demo(model: Optional[str] = typer.Option(None, help="HF Llama-family directory")):
    """Start a local deployment, drive a warm/cold multi-turn workload, print results, stop."""
    from cpd.demo import run_demo
    run_demo(model)


def _mount_subcommands() -> None:
    """Sub-commands built in their own packages (bench, simulator, analyzer, trace generator)."""
    from cpd.analyze.cli import analyze
    from cpd.bench.cli import app as bench_app
    from cpd.sim.cli import simulate
    from cpd.sim.gen import generate

    app.add_typer(bench_app, name="bench", help="Replay a trace against an OpenAI-compatible URL.")
    app.command("simulate")(simulate)
    app.command("analyze")(analyze)
    app.command("gen-trace")(generate)


_mount_subcommands()

if __name__ == "__main__":
    app()
