"""Simulator cores side by side on one reference point: the older core (cpd.sim.simulator) and the
core on the live engine objects (cpd.sim.engine_sim): TTFT p50/p90 over the steady window and
speed (simulated seconds per wall second).

    .venv/bin/python benchmarks/bench_sim_engine.py [--steady-s 30] [--qps-per-gpu 0.8] [CONFIG ...]
"""
from __future__ import annotations

import argparse
import json
import time

from cpd.sim.engine_experiment import run_engine_point
from cpd.sim.experiment import load_experiment, run_point


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["2P1D", "CPD-1D"])
    ap.add_argument("--steady-s", type=float, default=30.0)
    ap.add_argument("--qps-per-gpu", type=float, default=0.8)
    ap.add_argument("--experiment", default="reference_b200")
    a = ap.parse_args()
    exp = load_experiment(a.experiment)
    exp.update(ramp_s=5, steady_s=a.steady_s, drain_s=10)
    for cfg in a.configs:
        t = time.perf_counter()
        old = run_point(exp, cfg, a.qps_per_gpu)
        w_old = time.perf_counter() - t
        new = run_engine_point(exp, cfg, a.qps_per_gpu)
        print(json.dumps({"config": cfg, "qps_per_gpu": a.qps_per_gpu, "requests": new["requests"],
                          "old_core": {"ttft_s": {k: old["ttft_s"][k] for k in ("p50", "p90")},
                                       "sim_s_per_wall_s": round(old["simulated_s"] / w_old, 1)},
                          "engine_core": {"ttft_s": new["ttft_s"], "sim_s_per_wall_s": new["sim_s_per_wall_s"],
                                          "completion_ratio": new["completion_ratio"], "busy_s": new["busy_s"]}}),
              flush=True)


if __name__ == "__main__":
    main()
