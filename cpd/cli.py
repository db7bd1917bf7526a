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


API_KEY_HELP = "accepted client key, sent as Authorization: Bearer KEY (repeatable; none = no client auth)"
API_KEY_FILE_HELP = "file of 'KEY [TENANT]' lines (repeatable); a key's tenant isolates its KV cache"


def _add_api_keys(cfg: Any, keys: Optional[list[str]], key_files: Optional[list[str]]) -> None:
    """``--api-key`` / ``--api-key-file`` add to the config's ``[auth]`` keys."""
    if keys:
        cfg.auth.api_keys = [*cfg.auth.api_keys, *keys]
    if key_files:
        cfg.auth.api_key_files = [*cfg.auth.api_key_files, *key_files]


def _check_auth(cfg: Any) -> None:
    """Exit 2 with one line if the router could not read the API keys or the internal secret
    (as it would, after every worker had started)."""
    from cpd.router.api_keys import ApiKeys
    try:
        ApiKeys.build(cfg.auth.api_keys, cfg.auth.api_key_files)
        cfg.auth.secret()
    except (OSError, ValueError) as e:
        typer.echo(f"error: auth: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
@config_options
def serve(cfg: Any = None,
          api_key: Optional[list[str]] = typer.Option(None, "--api-key", help=API_KEY_HELP),
          api_key_file: Optional[list[str]] = typer.Option(None, "--api-key-file", help=API_KEY_FILE_HELP)) -> None:
    """Run a CPD (or plain P/D) deployment until Ctrl-C (SIGINT) or SIGTERM.

    Every setting comes from the configuration tree (``cpd config show`` prints it): defaults,
    then ``--config FILE``, then the flags below and ``--set SECTION.KEY=VALUE``.

    The launcher supervises its children: a worker or router that exits is restarted on the
    same ports with exponential backoff while the others keep serving (logged here and in
    LOG_DIR/<process>.log; counted in /metrics as cpd_process_restarts_total and listed at
    /cpd/processes). A worker whose /health keeps failing (engine stuck, no answer) for
    --liveness-timeout-s, or reports --liveness-max-failed-steps consecutive failed engine steps,
    and a router that does not answer /health for --liveness-timeout-s, are killed and restarted
    the same way (cpd.liveness). Only Ctrl-C/SIGTERM stops everything (router first, then workers)."""
    import logging

    from cpd.deploy import Deployment, DeploymentError

    cfg.model.dir = _resolve_model(cfg.model.dir)
    _add_api_keys(cfg, api_key, api_key_file)
    _check_auth(cfg)
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("cpd.deploy").setLevel(logging.INFO)
    stop = {"flag": False, "started": False}

    def on_signal(*_: Any) -> None:
        stop["flag"] = True
        if not stop["started"]:  # still starting: unwind start(), which stops what it started
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job starts with it ignored
        signal.signal(sig, on_signal)
    dep = Deployment(cfg, extra_env=_local_secret_env(cfg))
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
    except (DeploymentError, FileNotFoundError) as e:  # a child that cannot start says why (its last lines)
        typer.echo(f"cpd serve: {e}", err=True)
        raise typer.Exit(1) from None
    finally:
        stop["started"] = True  # a second signal while stopping must not interrupt the stop
        dep.stop()
        typer.echo("stopped")


def _local_secret_env(cfg: Any) -> dict[str, str]:
    """Without a configured internal secret, ``cpd serve`` makes a fresh one for its children: its
    workers then answer only its router (and each other's handoff fetches)."""
    import os

    from cpd.auth import SECRET_ENV
    if cfg.auth.internal_secret_file or os.environ.get(SECRET_ENV):
        return {}
    return {SECRET_ENV: secrets.token_hex(32)}


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def worker(ctx: typer.Context) -> None:
    """One engine process: ``cpd worker --role ROLE --router URL [--host IP] [--config FILE] [flags]``.

    It registers with the router at URL (again every few seconds, so either side may restart) and
    serves the internal API on --host:--port (default 9000; KV events on port+1). The shared
    secret comes from $CPD_INTERNAL_SECRET or [auth] internal_secret_file. All flags:
    ``cpd worker --help``."""
    from cpd.worker.main import main as worker_main
    worker_main(list(ctx.args))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def router(ctx: typer.Context) -> None:
    """The front door: ``cpd router --config FILE [--api-key KEY] [--served-from WORKER_URL]``.

    Serves the OpenAI API, keeps the global prefix index and routes to the workers listed in
    [router] workers and to every worker that registers (``cpd worker --router URL``). All
    flags: ``cpd router --help``."""
    from cpd.router.main import main as router_main
    router_main(list(ctx.args))


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
