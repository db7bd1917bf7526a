"""Whole cells (``cells/<key>.json``, the format and file name ``benchmarks/adaptive_grid.py`` writes)
from the per-(seed, configuration) searches of ``searches_with_points.py`` (its ``--points`` file):
a cell is written once all four configurations of every seed are there, with the grid's own
summaries (:func:`cpd.sim.sweep.saturation_summary`, ``adaptive_grid.cell_result``: mean and 95 %
t-interval of :mod:`cpd.sim.stats`) and a ``code`` key naming the commit the searches ran on.
Run from the repository root (or a snapshot of it):

    PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/mooncake_grid/make_cells.py \
        EXPERIMENT POINTS.jsonl CODE [--seeds 3]
"""
import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import adaptive_grid as G  # noqa: E402
from cpd.sim.experiment import load_experiment  # noqa: E402
from cpd.sim.sweep import saturation_summary  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS = (*G.OTHERS, G.ADAPTIVE)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("experiment")
    ap.add_argument("points")
    ap.add_argument("code")
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    base = load_experiment(a.experiment)
    by_cell: dict[tuple, dict] = {}
    for line in Path(a.points).read_text().splitlines():
        r = json.loads(line)
        by_cell.setdefault(tuple(r["cell"]), {})[(r["seed"], r["cfg"])] = r["result"]
    seeds = list(range(1, a.seeds + 1))
    for (wl, ttft, out), got in sorted(by_cell.items()):
        if not all((s, c) in got for s in seeds for c in CONFIGS):
            print(f"{wl} TTFT {ttft} out {out}: {len(got)} of {len(seeds) * len(CONFIGS)} searches, no cell file")
            continue
        cell = {"workload": wl, "cold": None, "ttft_s": ttft, "output": out}
        e = G.cell_experiment(base, cell)
        key = hashlib.sha256(json.dumps([e, a.seeds], sort_keys=True).encode()).hexdigest()[:16]
        res = {"seeds": seeds, "configs": {c: saturation_summary([got[(s, c)] for s in seeds]) for c in CONFIGS}}
        row = {"cell": cell, "result": G.cell_result(res), "code": a.code}
        f = HERE / "cells" / f"{key}.json"
        f.write_text(json.dumps(row, sort_keys=True, indent=1) + "\n")
        print(f"wrote {f.name}: ratio {row['result']['ratio']} {row['result']['ratio_ci']}")


if __name__ == "__main__":
    main()
