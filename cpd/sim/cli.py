"""``cpd simulate EXPERIMENT.json``: run a sweep, write results.json, PNG plots and report.md.

Mountable: ``app.command("simulate")(simulate)``; also ``python -m cpd.sim.cli EXPERIMENT``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer


def simulate(
    experiment: str = typer.Argument("reference_b200", help="experiment JSON, or a shipped name such as reference_b200"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="replay this trace (any format) as the workload"),
    users: Optional[int] = typer.Option(None, "--users", min=1, help="Claude Code: closed loop with N users"),
    shared_prefix_fraction: float = typer.Option(0.0, "--shared-prefix-fraction", min=0.0, max=1.0),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1, help="truncate to whole blocks (trace tokens)"),
    max_idle_s: Optional[float] = typer.Option(None, "--max-idle-s", min=0.0, help="cap pauses inside a session"),
    spread_ticks: bool = typer.Option(False, "--spread-ticks/--bursty-ticks"),
    out: Path = typer.Option(Path("sim_out"), "--out", "-o", help="output folder"),
    config: Optional[List[str]] = typer.Option(None, "--config", "-c", help="only these configurations"),
    qps: Optional[List[float]] = typer.Option(None, "--qps", help="only these QPS/GPU points"),
    steady_s: Optional[float] = typer.Option(None, help="override the steady window (s)"),
    study: bool = typer.Option(False, help="also run the cold-fraction x output-length study"),
    progress: bool = typer.Option(True, help="show a progress bar"),
    jobs: int = typer.Option(2, help="worker processes for independent sweep points (results do not depend on it)"),
) -> None:
    """Simulate the experiment's configurations over its load sweep (deterministic)."""
    from cpd.sim.experiment import load_experiment
    from cpd.sim.report import markdown, plot_sweep
    from cpd.sim.sweep import run_study, run_sweep

    exp = load_experiment(experiment)
    if trace is not None:
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
        typer.echo(f"trace {trace} on {exp.get('name')}: {exp.get('model')} on {exp.get('gpu')}, "
                   f"TTFT p90 SLO {exp.get('slo', {}).get('ttft_p90_s')} s; load points {exp['qps_per_gpu']} QPS/GPU "
                   "(timed traces: time-scaled; sessions: Poisson starts at QPS / requests per session)")
    if steady_s is not None:
        exp["steady_s"] = steady_s
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    res = run_sweep(exp, list(config) if config else None, list(qps) if qps else None, progress=progress, jobs=jobs)
    wall = time.perf_counter() - t
    sim_s = sum(p["simulated_s"] for p in res["points"])
    (out / "results.json").write_text(json.dumps(res, sort_keys=True, indent=1) + "\n")
    st = None
    if study and "study" in exp:
        st = run_study(exp, progress=progress, jobs=jobs)
        (out / "study.json").write_text(json.dumps(st, sort_keys=True, indent=1) + "\n")
    plot_sweep(res, out)
    (out / "report.md").write_text(markdown(res, exp, st))
    typer.echo(f"{len(res['points'])} points, {sim_s:.0f} simulated s in {wall:.1f} wall s "
               f"({sim_s / max(wall, 1e-9):.0f} simulated s per wall s)")
    for c, s in res["saturation"].items():
        typer.echo(f"  {c}: saturation {s['qps_per_gpu']} QPS/GPU ({s['bounded']})")
    typer.echo(f"wrote {out}/results.json, report.md, *.png")


app = typer.Typer(add_completion=False)
app.command("simulate")(simulate)

if __name__ == "__main__":
    typer.run(simulate)
