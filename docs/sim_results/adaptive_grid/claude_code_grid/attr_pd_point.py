"""pd, Claude Code TTFT 2 s, seed 1 at 3.5 nominal QPS/GPU on this snapshot (goodput; 864cf15 recorded 0.707506).
Run from a snapshot root that has a COMMIT file: PYTHONPATH=. nice -n 19 .venv/bin/python attr_pd_point.py"""
import json, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, run_point
e = G.cell_experiment(load_experiment("docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json"),
                      {"workload": "claude-code", "cold": None, "ttft_s": 2.0, "output": 100})
t = time.perf_counter(); p = run_point(e, "pd", 3.5, 1)
print(json.dumps({"code": open("COMMIT").read().strip(), "cfg": "pd", "q": 3.5, "seed": 1, "ttft_s": 2.0, "goodput": p["goodput"],
                  "requests": p["requests"], "wall_s": round(time.perf_counter() - t, 1)}), flush=True)
