"""Saturation search (cpd.sim.sweep.search_saturation) of one configuration, one agent cell and one
seed of ``reference_b200`` with the quick windows of ``benchmarks/adaptive_grid.py``, with optional
routing overrides; one JSON line. Run from the repository root (or a snapshot of it):

    PYTHONPATH=. nice -n 10 .venv/bin/python docs/sim_results/adaptive_grid/medium_work/saturation_one.py \
        CONFIG SEED COLD TTFT_S OUTPUT_TOKENS [routing_key=value ...]
"""
import json
import sys
import time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import adaptive_grid as G  # noqa: E402
from cpd.sim.experiment import load_experiment, with_overrides  # noqa: E402
from cpd.sim.sweep import search_saturation  # noqa: E402

cfg, seed, cold, ttft, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
e = G.cell_experiment(base, {"workload": "agent", "cold": cold, "ttft_s": ttft, "output": out})
ov = {}
for kv in sys.argv[6:]:
    k, v = kv.split("=")
    ov["routing." + k] = float(v)
e = with_overrides(e, ov)
t = time.perf_counter()
r = search_saturation(e, cfg, seed)
pts = [(p["qps_per_gpu"], p["goodput"]) for p in r["points"]]
print(json.dumps({"cfg": cfg, "seed": seed, "cell": [cold, ttft, out], "ov": ov, "sat": r["qps_per_gpu"], "pts": pts,
                  "wall_s": round(time.perf_counter() - t)}), flush=True)
