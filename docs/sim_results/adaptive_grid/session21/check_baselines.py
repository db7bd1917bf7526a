"""Session 21: the baselines' code path is unchanged since session 20's grid (6d3ad44), so the grid
may take pd, pd-l3 and cpd-static from there (adaptive_grid.py --baselines-from). Check: rerun some
baseline searches on this tree and compare with session 20's cell files (equal to the last digit).
PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/session21/check_baselines.py OUT.jsonl"""
import hashlib, json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation

S20 = Path("docs/sim_results/adaptive_grid/session20")
MOON = "docs/sim_results/adaptive_grid/decode2_short.experiment.json"
CHECKS = [  # (grid dir, base experiment, quick windows, cell, config, seed)
    ("agent", "reference_b200", True, {"workload": "agent", "cold": 0.0, "ttft_s": 0.5, "output": 100}, "pd-l3", 1),
    ("agent", "reference_b200", True, {"workload": "agent", "cold": 0.03, "ttft_s": 2.0, "output": 100}, "cpd-static", 2),
    ("agent", "reference_b200", True, {"workload": "agent", "cold": 0.15, "ttft_s": 1.0, "output": 400}, "pd", 3),
    ("mooncake", MOON, False, {"workload": "mooncake", "cold": None, "ttft_s": 0.5, "output": 100}, "pd-l3", 2),
]
out = open(sys.argv[1], "a")
for grid, exp, quick, cell, cfg, seed in CHECKS:
    base = load_experiment(exp)
    base = with_overrides(base, G.QUICK_EXP) if quick else base
    e = G.cell_experiment(base, cell)
    key = hashlib.sha256(json.dumps([e, 3], sort_keys=True).encode()).hexdigest()[:16]
    old = json.loads((S20 / grid / "cells" / f"{key}.json").read_text())["result"]["saturation"][cfg]["per_seed"][seed - 1]
    new = search_saturation(e, cfg, seed)["qps_per_gpu"]
    out.write(json.dumps({"cell": cell, "config": cfg, "seed": seed, "session20": old, "now": new,
                          "equal": old == round(new, 4)}) + "\n"); out.flush()
