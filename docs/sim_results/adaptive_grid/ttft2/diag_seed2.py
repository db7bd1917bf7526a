import json, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation
base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
e = G.cell_experiment(base, {"workload": "agent", "cold": 0.03, "ttft_s": 2.0, "output": 100})
cfg = sys.argv[1]
if len(sys.argv) > 2:
    e = dict(e, router_cost=sys.argv[2])
t = time.perf_counter()
r = search_saturation(e, cfg, 2)
out = {"config": cfg, "sat": r["qps_per_gpu"], "points": []}
for p in r["points"]:
    out["points"].append({k: p.get(k) for k in ("qps_per_gpu", "goodput", "ttft_s", "tpot_s", "ttft_cold_s", "ttft_warm_s", "pool_share", "busy_fraction", "hit_ratio", "cold_fraction", "rejected", "requests")})
print(json.dumps(out)[:3000], round(time.perf_counter() - t), "s")
