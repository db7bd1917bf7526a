"""Speed of the engine-object simulator on one reference point (one process): simulated seconds
per wall second and per CPU second (``time.process_time``: the stable figure on a shared
machine), peak RSS of the process so far, events, and where the time goes (``--profile``:
cProfile, top functions by own time).

    .venv/bin/python benchmarks/bench_sim_engine.py [--steady-s 30] [--qps-per-gpu 0.8] [--profile] [CONFIG ...]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import time

from cpd.sim.experiment import load_experiment, run_point


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["pd", "cpd-static"])
    ap.add_argument("--steady-s", type=float, default=30.0)
    ap.add_argument("--qps-per-gpu", type=float, default=0.8)
    ap.add_argument("--experiment", default="reference_b200")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    exp = load_experiment(a.experiment)
    exp.update(ramp_s=5, steady_s=a.steady_s, drain_s=10)
    for cfg in a.configs:
        prof = cProfile.Profile() if a.profile else None
        t, c = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.enable()
        p = run_point(exp, cfg, a.qps_per_gpu, seed=1)
        if prof is not None:
            prof.disable()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        print(json.dumps({"config": cfg, "qps_per_gpu": a.qps_per_gpu, "requests": p["requests"],
                          "simulated_s": p["simulated_s"], "wall_s": round(wall, 2),
                          "sim_s_per_wall_s": round(p["simulated_s"] / wall, 3), "cpu_s": round(cpu, 2),
                          "sim_s_per_cpu_s": round(p["simulated_s"] / cpu, 3),
                          "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                          "events": p["events"],
                          "ttft_s": p["ttft_s"], "goodput": p["goodput"], "busy_fraction": p["busy_fraction"]}),
              flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
