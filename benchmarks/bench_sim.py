"""Speed benchmark: the whole reference sweep (4 configs x 7 points x 690 simulated s).

Usage: ``.venv/bin/python benchmarks/bench_sim.py [EXPERIMENT] [--steady-s S]``.
Prints wall time and simulated seconds per wall second; target: <= 120 s on 2 cores.
"""
from __future__ import annotations

import argparse
import time

from cpd.sim.experiment import load_experiment
from cpd.sim.sweep import run_sweep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("experiment", nargs="?", default="reference_b200")
    ap.add_argument("--steady-s", type=float, default=None)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (2 cores here)")
    ap.add_argument("--configs", nargs="*", default=["2P1D", "2P2D", "CPD-1D", "CPD-2D"])
    a = ap.parse_args()
    exp = load_experiment(a.experiment)
    if a.steady_s:
        exp["steady_s"] = a.steady_s
    t = time.perf_counter()
    res = run_sweep(exp, a.configs, progress=True, jobs=a.jobs)
    wall = time.perf_counter() - t
    sim_s = sum(p["simulated_s"] for p in res["points"])
    ev = sum(p["events"] for p in res["points"])
    reqs = sum(p["requests"] for p in res["points"])
    print(f"{len(res['points'])} points, {sim_s:.0f} simulated s, {ev} events, {reqs} window requests")
    print(f"jobs={a.jobs}: wall {wall:.1f} s -> {sim_s / wall:.0f} simulated s per wall s, {ev / wall:.0f} events/s")
    for c, s in res["saturation"].items():
        print(f"  {c}: {s['qps_per_gpu']} QPS/GPU ({s['bounded']})")


if __name__ == "__main__":
    main()
