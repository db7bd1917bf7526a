"""Saturation search (cpd.sim.sweep.search_saturation) of one configuration on one trace cell of
``benchmarks/adaptive_grid.py`` (``--experiment docs/sim_results/adaptive_grid/decode2_short.experiment.json``,
the same cell experiment as the grid), one seed, with optional routing overrides; one JSON line.
Run from the repository root (or a snapshot of it):

    PYTHONPATH=. nice -n 10 .venv/bin/python docs/sim_results/adaptive_grid/mooncake_heavy_quarter/trace_saturation_one.py \
        WORKLOAD CONFIG SEED TTFT_S OUTPUT_TOKENS [routing_key=value ...]

WORKLOAD is ``mooncake`` or ``claude-code``. Example (the threshold before 43ba16b, half the SLO):
``... mooncake cpd 1 1 100 heavy_uncached_s=0.5``.
"""
import json
import sys
import time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import adaptive_grid as G  # noqa: E402
from cpd.sim.experiment import load_experiment, with_overrides  # noqa: E402
from cpd.sim.sweep import search_saturation  # noqa: E402

EXPERIMENT = "docs/sim_results/adaptive_grid/decode2_short.experiment.json"

wl, cfg, seed, ttft, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
e = G.cell_experiment(load_experiment(EXPERIMENT), {"workload": wl, "cold": None, "ttft_s": ttft, "output": out})
ov = {}
for kv in sys.argv[6:]:
    k, v = kv.split("=")
    ov["routing." + k] = float(v)
e = with_overrides(e, ov)
t = time.perf_counter()
r = search_saturation(e, cfg, seed)
pts = [(p["qps_per_gpu"], p["goodput"]) for p in r["points"]]
print(json.dumps({"workload": wl, "cfg": cfg, "seed": seed, "cell": [ttft, out], "ov": ov, "sat": r["qps_per_gpu"],
                  "pts": pts, "wall_s": round(time.perf_counter() - t)}), flush=True)
