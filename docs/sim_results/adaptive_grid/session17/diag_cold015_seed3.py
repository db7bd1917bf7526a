"""Agent cold 0.15 / TTFT 1 s / output 400, seed 3 (quick, reference_b200): the search points of pd-l3 and
adaptive cpd, to see where the 0.932 ratio comes from (../out400_8890a00/'s script, rerun on a21ba29). Run from
the repository root: PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/session17/diag_cold015_seed3.py"""
import json, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation
e = G.cell_experiment(with_overrides(load_experiment("reference_b200"), G.QUICK_EXP),
                      {"workload": "agent", "cold": 0.15, "ttft_s": 1.0, "output": 400})
for cfg in ("pd-l3", "cpd"):
    t = time.perf_counter(); r = search_saturation(e, cfg, 3)
    pts = [{k: p.get(k) for k in ("qps_per_gpu", "goodput", "requests", "ttft_s", "ttft_cold_s", "ttft_warm_s", "tpot_s", "pool_share", "busy_fraction")} for p in r["points"]]
    print(json.dumps({"cfg": cfg, "seed": 3, "sat": r["qps_per_gpu"], "points": pts, "wall_s": round(time.perf_counter() - t, 1)}, default=str), flush=True)
