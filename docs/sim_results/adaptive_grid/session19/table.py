"""Session 19's grid on one commit (issue 11): the three grid runs' cells in one table and one heat map.

    cd docs/sim_results/adaptive_grid/session19 && ../../../../.venv/bin/python table.py > table.md
    # another session's folder and runs (later sessions):
    .venv/bin/python docs/sim_results/adaptive_grid/session19/table.py FOLDER RUN... > FOLDER/table.md

Reads agent/, mooncake/ and claude_code/ (each a ``benchmarks/adaptive_grid.py --out`` folder; a run
still in progress contributes the cells it has finished) and writes grid_heatmap.png beside this file.
Per cell: each configuration's saturation (mean over seeds), adaptive ``cpd`` / best other per seed
(the best other of that seed), the goal (every seed >= 0.97) and ``cpd`` / ``pd`` per seed.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3] / "benchmarks"))
sys.path.insert(0, str(HERE.parents[3]))

import adaptive_grid as G  # noqa: E402

LINE = 0.97
RUNS = ("agent", "mooncake", "claude_code")


def rows(folder: Path = HERE, runs: tuple[str, ...] = RUNS) -> list[dict]:
    """Every finished cell of the grid runs ``runs`` under ``folder`` (a missing run: none)."""
    out = []
    for run in runs:
        for f in sorted((folder / run / "cells").glob("*.json")):
            out.append(json.loads(f.read_text()))
    order = {"agent": 0, "mooncake": 1, "claude-code": 2}
    return sorted(out, key=lambda r: (order[r["cell"]["workload"]], r["cell"]["cold"] or 0,
                                      r["cell"]["ttft_s"], r["cell"]["output"]))


def verdict(ratios: list) -> str:
    rs = [r for r in ratios if r is not None]
    if not rs:
        return "no ratio (no other configuration passes at any load)"
    if len(rs) < len(ratios):
        return f"{'pass' if min(rs) >= LINE else 'MISS'} on {len(rs)} of {len(ratios)} seeds (others: no ratio)"
    return "pass" if min(rs) >= LINE else "**MISS**"


def over_pd(s: dict) -> list:
    return [None if not p else round(a / p, 3) for a, p in zip(s["cpd"]["per_seed"], s["pd"]["per_seed"])]


def fmt(d: dict) -> str:
    x = d["saturation_qps_per_gpu"]
    return "—" if x is None else (">= " if d.get("at_least") else "") + f"{x:.3f}"


def main(folder: Path = HERE, runs: tuple[str, ...] = RUNS) -> None:
    """The table on stdout, the heat map as ``folder``/grid_heatmap.png (later sessions call it with theirs)."""
    rs = rows(folder, runs)
    print("| workload | TTFT SLO | output | pd | pd-l3 | cpd-static | cpd | cpd / best other per seed | "
          "mean [95 % CI] | goal (every seed >= 0.97) | cpd / pd per seed |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|---|---|")
    tally = {"pass": 0, "miss": 0, "none": 0}
    for r in rs:
        c, s = r["cell"], r["result"]
        per = s["ratio_per_seed"]
        v = verdict(per)
        tally["none" if v.startswith("no ratio") else "pass" if v.startswith("pass") else "miss"] += 1
        lo, hi = s["ratio_ci"]
        mean = "—" if s["ratio"] is None else f"{s['ratio']:.3f} [{lo:.3f}, {hi:.3f}]"
        sat = s["saturation"]
        print(f"| {G._label(c)} | {c['ttft_s']:g} s | {c['output']} | "
              + " | ".join(fmt(sat[k]) for k in ("pd", "pd-l3", "cpd-static", "cpd"))
              + f" | {', '.join('—' if x is None else f'{x:.3f}' for x in per)} | {mean} | {v} | "
              + ", ".join("—" if x is None else f"{x:.2f}" for x in over_pd(sat)) + " |")
    print(f"\n{len(rs)} cells: {tally['pass']} pass, {tally['miss']} miss, {tally['none']} without a ratio.")
    if rs:
        G.heatmap(rs, folder / "grid_heatmap.png")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        main(Path(sys.argv[1]).resolve(), tuple(sys.argv[2:]))
    else:
        main()
