"""``cpd simulate``: sweeps and configuration comparisons on the engine-object simulator.

* ``cpd simulate [EXPERIMENT] [--trace PATH]``: every configuration over the load grid for
  ``--seeds`` seeds; writes ``results.json``, PNG plots and ``report.md`` to ``--out``.
* ``cpd simulate --compare pd,pd-l3,cpd-static,cpd [EXPERIMENT | --trace PATH] [--seeds N]
  [--json FILE]``: each configuration's sustainable QPS/GPU (saturation search per seed, mean
  and 95 % t-interval over seeds) printed as a table; ``--json`` writes
  ``{"configs": {NAME: {"saturation_qps_per_gpu", "ci": [lo, hi], ...}}}``.

``--quick`` shortens every point (10 s ramp, 60 s steady window, 30 s drain, 2 bisection
steps) to fit a small machine; the figures are then noisier (wider intervals).
Mountable: ``app.command("simulate")(simulate)``; also ``python -m cpd.sim.cli``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer

QUICK = {"ramp_s": 10, "steady_s": 60, "drain_s": 30}


def _apply_trace(exp: dict, trace: Path, users, spread_ticks, shared_prefix_fraction, max_context, max_idle_s) -> None:
    from cpd.sim.experiment import _read_trace_cached
    try:
        _read_trace_cached(str(trace))
    except ValueError as e:  # TraceFormatError: file, line, what was expected
        typer.echo(f"cpd simulate: {e}", err=True)
        raise typer.Exit(2) from None
    exp["workload"] = {"kind": "trace", "path": str(trace), "users": users, "spread_ticks": spread_ticks,
                       "shared_prefix_fraction": shared_prefix_fraction, "max_context": max_context,
                       "max_idle_s": max_idle_s}
    exp["name"] = f"{exp.get('name', 'sweep')} on {trace.name}"


def compare_table(res: dict) -> str:
    """The ``--compare`` table (markdown)."""
    lines = [f"| configuration | GPUs | saturation QPS/GPU | 95 % CI | seeds | busy at saturation |",
             "|---|---:|---:|---|---:|---|"]
    for c, d in res["configs"].items():
        x = d["saturation_qps_per_gpu"]
        lo, hi = d["ci"]
        bound = ">= " if d.get("at_least") else ""
        busy = ", ".join(f"{k} {v:.2f}" for k, v in d.get("busy_fraction_at_saturation", {}).items())
        lines.append(f"| {c} | {d['num_gpus']} | {bound}{'—' if x is None else f'{x:.3f}'} | "
                     f"[{'—' if lo is None else f'{lo:.3f}'}, {'—' if hi is None else f'{hi:.3f}'}] | "
                     f"{d['n_seeds']} | {busy or '—'} |")
    return "\n".join(lines) + "\n"


def simulate(
    experiment: str = typer.Argument("reference_b200", help="experiment JSON, or a shipped name such as reference_b200"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="replay this trace (any format) as the workload"),
    compare: Optional[str] = typer.Option(None, "--compare", help="comma-separated configurations: saturation search"),
    seeds: Optional[int] = typer.Option(None, "--seeds", min=1, help="seeds per point (default: the experiment's, else 3)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="--compare: write the result here"),
    quick: bool = typer.Option(False, "--quick", help="short points for a small machine (see module docstring)"),
    users: Optional[int] = typer.Option(None, "--users", min=1, help="Claude Code: closed loop with N users"),
    shared_prefix_fraction: float = typer.Option(0.0, "--shared-prefix-fraction", min=0.0, max=1.0),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1, help="truncate to whole blocks (trace tokens)"),
    max_idle_s: Optional[float] = typer.Option(None, "--max-idle-s", min=0.0, help="cap pauses inside a session"),
    spread_ticks: bool = typer.Option(False, "--spread-ticks/--bursty-ticks"),
    out: Path = typer.Option(Path("sim_out"), "--out", "-o", help="output folder (sweep)"),
    config: Optional[List[str]] = typer.Option(None, "--config", "-c", help="only these configurations (sweep)"),
    qps: Optional[List[float]] = typer.Option(None, "--qps", help="only these QPS/GPU points (sweep) / search grid"),
    steady_s: Optional[float] = typer.Option(None, help="override the steady window (s)"),
    progress: bool = typer.Option(True, help="show progress"),
    jobs: int = typer.Option(2, help="worker processes for independent points (results do not depend on it)"),
) -> None:
    """Simulate configurations of an experiment (deterministic for given seeds)."""
    from cpd.sim.experiment import load_experiment, slo_of

    try:
        exp = load_experiment(experiment)
    except (OSError, ValueError) as e:  # no such experiment, or not an experiment JSON
        typer.echo(f"cpd simulate: {e}" if experiment in str(e) else f"cpd simulate: {experiment}: {e}", err=True)
        raise typer.Exit(2) from None
    if qps and min(qps) <= 0:
        raise typer.BadParameter(f"QPS/GPU points must be positive, got {qps}", param_hint="--qps")
    if trace is not None:
        _apply_trace(exp, trace, users, spread_ticks, shared_prefix_fraction, max_context, max_idle_s)
    if quick:
        exp.update(QUICK)
        exp.setdefault("search", {})["iters"] = 2
    if steady_s is not None:
        exp["steady_s"] = steady_s
    if qps:
        exp["qps_per_gpu"] = sorted(qps)
    slo = slo_of(exp)
    typer.echo(f"{exp.get('name')}: {exp.get('model')} on {exp.get('gpu')}; SLO TTFT <= {slo['ttft_s']} s and "
               f"TPOT <= {slo['tpot_s']} s for >= {slo['goodput_min']:.0%} of requests; load grid "
               f"{exp['qps_per_gpu']} QPS/GPU; window {exp.get('ramp_s', 30)} s ramp + {exp.get('steady_s', 600)} s")
    t = time.perf_counter()
    if compare is not None:
        _compare(exp, compare, seeds, jobs, json_out, progress)
    else:
        _sweep(exp, config, seeds, jobs, out, progress)
    typer.echo(f"wall {time.perf_counter() - t:.1f} s")


def _compare(exp: dict, names: str, seeds, jobs: int, json_out: Optional[Path], progress: bool) -> None:
    from cpd.sim.experiment import config_spec
    from cpd.sim.sweep import compare as run_compare

    cfgs = [c.strip() for c in names.split(",") if c.strip()]
    try:
        for c in cfgs:
            config_spec(exp, c)
    except KeyError as e:
        typer.echo(f"cpd simulate: {e.args[0]}", err=True)
        raise typer.Exit(2) from None

    def done(cfg: str, seed: int, r: dict) -> None:
        if progress:
            typer.echo(f"  {cfg} seed {seed}: {r['qps_per_gpu']} QPS/GPU ({r['bounded']}, {len(r['points'])} points)")
    res = run_compare(exp, cfgs, seeds, jobs, on_done=done)
    typer.echo(compare_table(res))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, sort_keys=True, indent=1) + "\n")
        typer.echo(f"wrote {json_out}")


def _sweep(exp: dict, config, seeds, jobs: int, out: Path, progress: bool) -> None:
    from cpd.sim.report import markdown, plot_sweep
    from cpd.sim.sweep import run_sweep

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        typer.echo(f"cpd simulate: cannot write the results to --out {out}: {e.strerror or e}", err=True)
        raise typer.Exit(2) from None
    t = time.perf_counter()
    res = run_sweep(exp, list(config) if config else None, seeds=seeds, progress=progress, jobs=jobs)
    wall = time.perf_counter() - t
    sim_s = sum(p["simulated_s"] for p in res["points"])
    (out / "results.json").write_text(json.dumps(res, sort_keys=True, indent=1) + "\n")
    plot_sweep(res, out)
    (out / "report.md").write_text(markdown(res, exp))
    typer.echo(f"{len(res['points'])} points, {sim_s:.0f} simulated s in {wall:.1f} wall s "
               f"({sim_s / max(wall, 1e-9):.2f} simulated s per wall s, {jobs} jobs)")
    for c, s in res["saturation"].items():
        typer.echo(f"  {c}: saturation {s['qps_per_gpu']} QPS/GPU, 95 % CI {s['ci']} ({s['bounded']})")
    typer.echo(f"wrote {out}/results.json, report.md, *.png")


app = typer.Typer(add_completion=False)
app.command("simulate")(simulate)

if __name__ == "__main__":
    typer.run(simulate)
