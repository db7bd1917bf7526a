"""The ``cpd`` command: serve, config show, bench, simulate, analyze, demo."""
from __future__ import annotations

import secrets
import functools
import inspect
import signal
import time
from typing import Any, Callable, Optional

import typer

app = typer.Typer(help="cpd: cache-aware prefill-decode disaggregation for LLM serving.",
                  no_args_is_help=True, add_completion=False)


def _resolve_model(model: Optional[str]) -> str:
    if model:
        return model
    from cpd.engine.weights import default_model_dir
    return str(default_model_dir())


def _flag_type(key: str) -> type:
    """Command-line type of a config key: sizes stay text (``512M``), the rest as declared."""
    from cpd.config import field_info
    if key.endswith("_bytes"):
        return str
    ann = field_info(key)[0]
    for t in (bool, int, float):
        if ann is t or ann == Optional[t]:
            return t
    return str


def config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command ``--config FILE``, repeatable ``--set KEY=VALUE`` and one option per
    :data:`cpd.config.FLAGS` entry (help text from the config tree). The command receives
    the effective :class:`cpd.config.Config` as its ``cfg`` argument instead."""
    from cpd.config import FLAGS, ConfigError, build_config, field_info, parse_assignments

    own = [p for p in inspect.signature(func).parameters.values() if p.name != "cfg"]
    extra = [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                               default=typer.Option(None, "--config", help="config file (.toml, .yaml, .json)")),
             inspect.Parameter("set_", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[list[str]],
                               default=typer.Option(None, "--set", help="override any key: SECTION.KEY=VALUE "
                                                                        "(repeatable)"))]
    for f in FLAGS:
        t = _flag_type(f.key)
        names = f.names if t is not bool else tuple(f"{n}/--no-{n[2:]}" for n in f.names[:1])
        extra.append(inspect.Parameter(_param_name(f.key), inspect.Parameter.KEYWORD_ONLY,
                                       annotation=Optional[t],
                                       default=typer.Option(None, *names, help=f"{field_info(f.key)[1]} (key {f.key})")))

    @functools.wraps(func)
    def wrapper(**kw: Any) -> Any:
        overrides = {f.key: kw.pop(_param_name(f.key)) for f in FLAGS}
        try:
            overrides.update(parse_assignments(kw.pop("set_") or []))
            cfg = build_config(kw.pop("config"), overrides)
        except ConfigError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        return func(cfg=cfg, **kw)

    wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


def _param_name(key: str) -> str:
    return "opt_" + key.replace(".", "__")


@app.command()
@config_options
def serve(cfg: Any = None) -> None:
    """Run a CPD (or plain P/D) deployment until Ctrl-C (SIGINT) or SIGTERM.

    Every setting comes from the configuration tree (``cpd config show`` prints it): defaults,
    then ``--config FILE``, then the flags below and ``--set SECTION.KEY=VALUE``.

    The launcher supervises its children: a worker or router that exits is restarted on the
    same ports with exponential backoff while the others keep serving (logged here and in
    LOG_DIR/<process>.log; counted in /metrics as cpd_process_restarts_total and listed at
    /cpd/processes). Only Ctrl-C/SIGTERM stops everything (router first, then workers)."""
    import logging

    from cpd.deploy import Deployment

    cfg.model.dir = _resolve_model(cfg.model.dir)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("cpd.deploy").setLevel(logging.INFO)
    stop = {"flag": False, "started": False}

    def on_signal(*_: Any) -> None:
        stop["flag"] = True
        if not stop["started"]:  # still starting: unwind start(), which stops what it started
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job starts with it ignored
        signal.signal(sig, on_signal)
    dep = Deployment(cfg)
    typer.echo(f"starting {cfg.deployment.topology}: {', '.join(cfg.deployment.roles())} (model {cfg.model.dir})")
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


config_app = typer.Typer(help="The configuration tree shared by every cpd process.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
@config_options
def config_show(cfg: Any = None,
                fmt: str = typer.Option("toml", "--format", help="toml, json or yaml")) -> None:
    """Print the effective configuration (defaults < --config FILE < flags and --set)."""
    from cpd.config import dump
    if fmt not in ("toml", "json", "yaml"):
        typer.echo("error: --format must be toml, json or yaml", err=True)
        raise typer.Exit(2)
    typer.echo(dump(cfg, fmt), nl=False)  # type: ignore[arg-type]


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
