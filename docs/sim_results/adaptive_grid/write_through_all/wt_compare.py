import json, sys, time
sys.argv=[sys.argv[0]]
sys.path.insert(0, 'benchmarks')
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import compare
out = {}
jobs = [
  ("reference_quick cold0 ttft1", "reference_b200", True, {"workload": "agent", "cold": 0.0, "ttft_s": 1.0, "output": 100}, 3),
  ("reference_quick cold0.08 ttft1", "reference_b200", True, {"workload": "agent", "cold": 0.08, "ttft_s": 1.0, "output": 100}, 2),
  ("mooncake decode2_short ttft1", "/work/main/docs/sim_results/adaptive_grid/decode2_short.experiment.json", False, {"workload": "mooncake", "cold": None, "ttft_s": 1.0, "output": 100}, 2),
]
for name, exp_name, quick, cell, seeds in jobs:
    base = load_experiment(exp_name)
    if quick:
        base = with_overrides(base, G.QUICK_EXP)
    e = G.cell_experiment(base, cell)
    t = time.perf_counter()
    res = compare(e, ["cpd-all"], seeds, 2)
    c = res["configs"]["cpd-all"]
    out[name] = {"per_seed": c["per_seed"], "saturation": c["saturation_qps_per_gpu"], "ci": c["ci"]}
    print(name, out[name], round(time.perf_counter() - t), "s", flush=True)
    json.dump(out, open("/work/main/sim_out/wt_all.json", "w"), indent=1)
