"""Saturation search (QPS/GPU per seed) of adaptive `cpd` alone on cells of benchmarks/adaptive_grid.py
(the other configurations do not route adaptively, so a change to the adaptive rules leaves them
as recorded). Run from the repository root, once per tree to compare:

    PYTHONPATH=. nice -n 10 .venv/bin/python docs/sim_results/adaptive_grid/spill_past_slo/cell_compare.py \
        /tmp/cells.json cold0,cold0.08,cold0.08t05,mooncake
"""
import json
import sys
import time

out_path, which = sys.argv[1], sys.argv[2].split(',')
sys.argv = [sys.argv[0]]
sys.path.insert(0, 'benchmarks')
sys.path.insert(0, '.')
import adaptive_grid as G  # noqa: E402
from cpd.sim.experiment import load_experiment, with_overrides  # noqa: E402
from cpd.sim.sweep import compare  # noqa: E402

DECODE2 = "docs/sim_results/adaptive_grid/decode2_short.experiment.json"
JOBS = {
    "cold0": ("reference_quick cold0 ttft1", "reference_b200", True,
              {"workload": "agent", "cold": 0.0, "ttft_s": 1.0, "output": 100}, 3),
    "cold0.08": ("reference_quick cold0.08 ttft1", "reference_b200", True,
                 {"workload": "agent", "cold": 0.08, "ttft_s": 1.0, "output": 100}, 2),
    "cold0.08t05": ("reference_quick cold0.08 ttft0.5", "reference_b200", True,
                    {"workload": "agent", "cold": 0.08, "ttft_s": 0.5, "output": 100}, 2),
    "mooncake": ("mooncake decode2_short ttft1", DECODE2, False,
                 {"workload": "mooncake", "cold": None, "ttft_s": 1.0, "output": 100}, 2),
}
out = {}
for key in which:
    name, exp_name, quick, cell, seeds = JOBS[key]
    base = load_experiment(exp_name)
    if quick:
        base = with_overrides(base, G.QUICK_EXP)
    t = time.perf_counter()
    c = compare(G.cell_experiment(base, cell), ["cpd"], seeds, 1)["configs"]["cpd"]
    out[name] = {"per_seed": c["per_seed"], "saturation": c["saturation_qps_per_gpu"], "ci": c["ci"],
                 "wall_s": round(time.perf_counter() - t)}
    print(name, out[name], flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
