"""Speed benchmark: a reference sweep on the engine-object simulator (configs x grid x seeds).

Usage: ``.venv/bin/python benchmarks/bench_sim.py [EXPERIMENT] [--steady-s S] [--seeds N] [--jobs J]
[--configs pd cpd ...] [--qps 0.4 0.8 ...]``. Prints wall time, simulated seconds per wall
second (over all jobs) and the work done; the full sweep's cost follows from the rate (the
issue's goal, <= 120 s for the full reference sweep on 2 cores, is not met: see
docs/simulator.md "Speed").
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
    ap.add_argument("--ramp-s", type=float, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--qps", nargs="*", type=float, default=None)
    a = ap.parse_args()
    exp = load_experiment(a.experiment)
    if a.steady_s:
        exp["steady_s"] = a.steady_s
    if a.ramp_s is not None:
        exp["ramp_s"] = a.ramp_s
    t = time.perf_counter()
    res = run_sweep(exp, a.configs, a.qps, seeds=a.seeds, progress=True, jobs=a.jobs)
    wall = time.perf_counter() - t
    sim_s = sum(p["simulated_s"] for p in res["points"])
    ev = sum(p["events"] for p in res["points"])
    reqs = sum(p["requests"] for p in res["points"])
    full = len(exp["configs"]) * len(exp["qps_per_gpu"]) * int(exp.get("seeds", 3)) * (
        load_experiment(a.experiment).get("ramp_s", 30) + load_experiment(a.experiment).get("steady_s", 600)
        + exp.get("drain_s", 60))
    print(f"{len(res['points'])} points, {sim_s:.0f} simulated s, {ev} events, {reqs} window requests")
    print(f"jobs={a.jobs}: wall {wall:.1f} s -> {sim_s / wall:.2f} simulated s per wall s, {ev / wall:.0f} events/s")
    print(f"full reference sweep = {full:.0f} simulated s -> about {full / (sim_s / wall) / 3600:.1f} h at this rate")
    for c, s in res["saturation"].items():
        print(f"  {c}: {s['qps_per_gpu']} QPS/GPU, 95 % CI {s['ci']} ({s['bounded']})")


if __name__ == "__main__":
    main()
