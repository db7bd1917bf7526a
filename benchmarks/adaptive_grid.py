"""Where does adaptive CPD pay? A grid of workload cells, each comparing the sustainable QPS/GPU
of adaptive ``cpd`` with the best of ``pd``, ``pd-l3`` and ``cpd-static`` (same GPUs) on the
engine-object simulator (saturation search per seed, :mod:`cpd.sim.sweep`).

Cells: synthetic agent workload: cold fraction (0, 0.03, 0.08, 0.15) x TTFT SLO (0.5, 1, 2 s) x
output length (100, 400 tokens); traces (``--workloads``: the Mooncake conversation trace and the
Claude Code sessions under /work/shared/data/traces/): TTFT SLO x output cap (their cold share
is their own). Per cell and seed the ratio ``cpd / max(others)`` of saturations; the cell shows
its mean over seeds with a 95 % t-interval.

    .venv/bin/python benchmarks/adaptive_grid.py [--quick] [--jobs N] [--seeds N] [--out DIR]
        [--workloads agent,mooncake,claude-code] [--experiment reference_b200]

Writes ``DIR/grid.json``, ``DIR/grid.md`` (table) and ``DIR/grid_heatmap.png``; each finished
cell is kept in ``DIR/cells/`` and skipped on a rerun (an interrupted grid resumes). ``--quick``
(sized for a 2-core machine, tens of minutes): agent cells cold (0.03, 0.15) x TTFT 1 s x output
100, 2 seeds, 5 s ramp + 20 s window, loads 0.4/0.8/1.2 QPS/GPU, one bisection step: a smoke
test of the pipeline whose figures have wide intervals. The full grid is hours of CPU: run it
with many ``--jobs`` on a large machine.

``--baselines-from DIR`` takes ``pd``, ``pd-l3`` and ``cpd-static`` of each cell from an earlier
grid's ``DIR/cells/`` (same experiment, cell and seeds) and searches only adaptive ``cpd``: after a
change to the adaptive policy alone, a quarter of the work. Valid only while the baselines' code
path is unchanged since that grid (check: rerun one baseline search, compare the figures).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpd.sim.experiment import QUICK_WINDOWS, load_experiment, with_overrides  # noqa: E402
from cpd.sim.stats import mean_ci, rnd  # noqa: E402
from cpd.sim.sweep import compare  # noqa: E402

TRACES = Path("/work/shared/data/traces")
OTHERS = ("pd", "pd-l3", "cpd-static")
ADAPTIVE = "cpd"
FULL = {"cold": (0.0, 0.03, 0.08, 0.15), "ttft": (0.5, 1.0, 2.0), "output": (100, 400)}
QUICK = {"cold": (0.03, 0.15), "ttft": (1.0,), "output": (100,)}
QUICK_EXP = QUICK_WINDOWS
TRACE_WORKLOADS = {
    "mooncake": {"kind": "trace", "path": str(TRACES / "mooncake" / "conversation_trace.jsonl"), "spread_ticks": True},
    "claude-code": {"kind": "trace", "path": str(TRACES / "claude_code"), "max_idle_s": 60.0},
}


def cells(workloads: list[str], grid: dict) -> list[dict]:
    """Every cell: ``{"workload", "cold", "ttft_s", "output"}`` (``cold`` None for traces)."""
    out = []
    for wl in workloads:
        colds = grid["cold"] if wl == "agent" else (None,)
        for c in colds:
            for t in grid["ttft"]:
                for o in grid["output"]:
                    out.append({"workload": wl, "cold": c, "ttft_s": t, "output": o})
    return out


def cell_experiment(base: dict, cell: dict) -> dict:
    """The experiment of one cell. A trace cell replays ``TRACE_WORKLOADS[workload]`` updated by the
    experiment's ``trace_replay[workload]`` (replay options such as ``time_scale`` or ``max_idle_s``)."""
    ov: dict = {"slo.ttft_s": cell["ttft_s"]}
    if cell["workload"] == "agent":
        ov.update({"workload.cold_fraction": cell["cold"], "workload.output_tokens": cell["output"]})
        return with_overrides(base, ov)
    e = with_overrides(base, ov)
    e["workload"] = dict(TRACE_WORKLOADS[cell["workload"]], max_output_tokens=cell["output"],
                         **base.get("trace_replay", {}).get(cell["workload"], {}))
    return e


def cell_result(res: dict) -> dict:
    """Saturations per configuration and the per-seed ratio adaptive / best of the others."""
    cf = res["configs"]
    ratios = []
    for k in range(len(res["seeds"])):
        best = max(cf[c]["per_seed"][k] or 0.0 for c in OTHERS)
        a = cf[ADAPTIVE]["per_seed"][k]
        ratios.append(a / best if best > 0 and a is not None else None)
    ci = mean_ci(ratios)
    best_other = max(OTHERS, key=lambda c: cf[c]["saturation_qps_per_gpu"] or 0.0)
    return {"saturation": {c: {k: cf[c][k] for k in ("saturation_qps_per_gpu", "ci", "per_seed", "at_least")}
                           for c in (*OTHERS, ADAPTIVE)},
            "best_other": best_other, "ratio": rnd(ci["mean"], 4), "ratio_ci": [rnd(ci["lo"], 4), rnd(ci["hi"], 4)],
            "ratio_per_seed": [rnd(r, 4) for r in ratios], "seeds": res["seeds"]}


def _compare_cell(e: dict, seeds: int, jobs: int, baselines: Path | None) -> dict:
    """:func:`cpd.sim.sweep.compare` of the four configurations, or of adaptive ``cpd`` alone with the
    others' saturations read from ``baselines`` (an earlier grid's cell file for the same key)."""
    if baselines is None:
        return compare(e, [*OTHERS, ADAPTIVE], seeds, jobs)
    if not baselines.exists():
        raise SystemExit(f"--baselines-from: no cell {baselines} (another experiment, cell or seed count?)")
    old = json.loads(baselines.read_text())["result"]
    res = compare(e, [ADAPTIVE], seeds, jobs)
    if list(old["seeds"]) != list(res["seeds"]):
        raise SystemExit(f"--baselines-from: {baselines} has seeds {old['seeds']}, this run {res['seeds']}")
    res["configs"].update({c: old["saturation"][c] for c in OTHERS})
    return res


def _label(cell: dict) -> str:
    return cell["workload"] if cell["cold"] is None else f"agent cold {cell['cold']:g}"


def markdown(rows: list[dict], meta: dict) -> str:
    L = ["# Adaptive CPD vs the best other configuration", "",
         f"Engine-object simulator, {meta['experiment']}; {meta['seeds']} seeds per cell; window "
         f"{meta['ramp_s']} s ramp + {meta['steady_s']} s; goodput >= {meta['goodput_min']} under TTFT <= cell SLO and "
         f"TPOT <= {meta['tpot_s']} s. Ratio = saturation of `cpd` (adaptive) / max(pd, pd-l3, cpd-static), "
         "mean over seeds [95 % t-interval]. `>= x`: that configuration met the SLOs up to the search cap "
         "(a lower bound; a ratio involving it is not a measurement).", "",
         "| workload | TTFT SLO (s) | output | pd | pd-l3 | cpd-static | cpd | best other | ratio [95 % CI] |",
         "|---|---:|---:|---:|---:|---:|---:|---|---|"]

    def f(d):
        x = d["saturation_qps_per_gpu"]
        return "—" if x is None else (">= " if d.get("at_least") else "") + f"{x:.2f}"
    for r in rows:
        c, s = r["cell"], r["result"]
        lo, hi = s["ratio_ci"]
        rt = "—" if s["ratio"] is None else f"{s['ratio']:.2f} [{lo:.2f}, {hi:.2f}]"
        L.append(f"| {_label(c)} | {c['ttft_s']:g} | {c['output']} | " + " | ".join(f(s["saturation"][k]) for k in
                 (*OTHERS, ADAPTIVE)) + f" | {s['best_other']} | {rt} |")
    return "\n".join(L) + "\n"


def heatmap(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ys = list(dict.fromkeys(_label(r["cell"]) for r in rows))
    xs = list(dict.fromkeys(f"TTFT {r['cell']['ttft_s']:g} s\nout {r['cell']['output']}" for r in rows))
    m = np.full((len(ys), len(xs)), np.nan)
    capped = np.zeros((len(ys), len(xs)), dtype=bool)
    for r in rows:
        x = xs.index(f"TTFT {r['cell']['ttft_s']:g} s\nout {r['cell']['output']}")
        y = ys.index(_label(r["cell"]))
        if r["result"]["ratio"] is not None:
            m[y, x] = r["result"]["ratio"]
        capped[y, x] = any(v.get("at_least") for v in r["result"]["saturation"].values())
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(xs) + 3), 0.7 * len(ys) + 2))
    im = ax.imshow(m, cmap="RdYlGn", vmin=0.6, vmax=1.4, aspect="auto")
    ax.set_xticks(range(len(xs)), xs, fontsize=8)
    ax.set_yticks(range(len(ys)), ys, fontsize=8)
    for y in range(len(ys)):
        for x in range(len(xs)):
            if not np.isnan(m[y, x]):
                ax.text(x, y, f"{m[y, x]:.2f}" + ("*" if capped[y, x] else ""), ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="cpd / best other")
    ax.set_title("Adaptive CPD / best other configuration (saturation QPS/GPU)\n"
                 "* = a configuration never failed up to the search cap (ratio of lower bounds)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=None, help="default: 2 with --quick, else 3")
    ap.add_argument("--out", default="sim_out/adaptive_grid")
    ap.add_argument("--experiment", default="reference_b200")
    ap.add_argument("--workloads", default=None, help="comma-separated: agent, mooncake, claude-code "
                                                      "(default: agent with --quick, else all three)")
    ap.add_argument("--cold", default=None, help="comma-separated cold fractions (default: the grid's)")
    ap.add_argument("--ttft", default=None, help="comma-separated TTFT SLOs in s (default: the grid's)")
    ap.add_argument("--output", default=None, help="comma-separated output lengths (default: the grid's)")
    ap.add_argument("--baselines-from", default=None, help="an earlier grid's DIR: take pd, pd-l3 and cpd-static "
                                                           "from its cells, search only cpd")
    a = ap.parse_args(argv)
    base = load_experiment(a.experiment)
    if a.quick:
        base = with_overrides(base, QUICK_EXP)
    seeds = a.seeds or (2 if a.quick else 3)
    wls = (a.workloads or ("agent" if a.quick else "agent,mooncake,claude-code")).split(",")
    for w in wls:
        if w != "agent" and w not in TRACE_WORKLOADS:
            ap.error(f"unknown workload {w!r}")
    out = Path(a.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    grid = dict(QUICK if a.quick else FULL)
    for k, conv in (("cold", float), ("ttft", float), ("output", int)):
        if getattr(a, k):
            grid[k] = tuple(conv(x) for x in getattr(a, k).split(","))
    for cell in cells(wls, grid):
        e = cell_experiment(base, cell)
        key = hashlib.sha256(json.dumps([e, seeds], sort_keys=True).encode()).hexdigest()[:16]
        f = out / "cells" / f"{key}.json"
        if f.exists():
            rows.append(json.loads(f.read_text()))
            continue
        t = time.perf_counter()
        res = _compare_cell(e, seeds, a.jobs, Path(a.baselines_from) / "cells" / f.name if a.baselines_from else None)
        row = {"cell": cell, "result": cell_result(res)}
        f.write_text(json.dumps(row, sort_keys=True, indent=1) + "\n")
        rows.append(row)
        print(f"{_label(cell)} TTFT {cell['ttft_s']} out {cell['output']}: ratio {row['result']['ratio']} "
              f"{row['result']['ratio_ci']} ({time.perf_counter() - t:.0f} s)", flush=True)
    slo = base.get("slo", {})
    meta = {"experiment": a.experiment, "seeds": seeds, "ramp_s": base.get("ramp_s"), "steady_s": base.get("steady_s"),
            "goodput_min": slo.get("goodput_min", 0.9), "tpot_s": slo.get("tpot_s", 0.05), "quick": a.quick}
    (out / "grid.json").write_text(json.dumps({"meta": meta, "cells": rows}, sort_keys=True, indent=1) + "\n")
    (out / "grid.md").write_text(markdown(rows, meta))
    heatmap(rows, out / "grid_heatmap.png")
    print(markdown(rows, meta))
    print(f"wrote {out}/grid.json, grid.md, grid_heatmap.png ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
