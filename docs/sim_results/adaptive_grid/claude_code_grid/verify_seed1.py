"""Does this tree reproduce seed 1's points from b7181b1 (pd, pd-l3, cpd at 1.5 nominal QPS/GPU, TTFT 1 s)?
Run from the repository root: PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/claude_code_grid/verify_seed1.py"""
import json, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, run_point
e = G.cell_experiment(load_experiment("docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json"),
                      {"workload": "claude-code", "cold": None, "ttft_s": 1.0, "output": 100})
old = {"pd": 0.92236, "pd-l3": 0.964444, "cpd": 0.953333}
for cfg, g in old.items():
    t = time.perf_counter(); p = run_point(e, cfg, 1.5, 1)
    print(json.dumps({"cfg": cfg, "q": 1.5, "seed": 1, "goodput_b7181b1": g, "goodput_now": p["goodput"], "requests": p["requests"],
                      "same": p["goodput"] == g, "wall_s": round(time.perf_counter() - t, 1)}), flush=True)
