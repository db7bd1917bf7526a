"""Probe: does the Claude Code cell separate the configurations with compressed sessions (time_scale 4,
pauses capped at 20 s, 60 s ramp + 60 s window)? One seed, fixed nominal loads, all four configurations;
one JSON line per point. Run from the repository root:
PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/claude_code_grid/probe_points.py TTFT_S SEED LOADS"""
import json, sys, time
from cpd.sim.experiment import load_experiment, run_point, with_overrides
sys.path.insert(0, "benchmarks")
from adaptive_grid import TRACE_WORKLOADS
ttft, seed = float(sys.argv[1]), int(sys.argv[2])
loads = [float(x) for x in sys.argv[3].split(",")]
base = load_experiment("docs/sim_results/adaptive_grid/decode2_short.experiment.json")
e = with_overrides(base, {"ramp_s": 60, "steady_s": 60, "slo.ttft_s": ttft})
e["workload"] = dict(TRACE_WORKLOADS["claude-code"], max_output_tokens=100, time_scale=4.0, max_idle_s=20.0)
for q in loads:
    for cfg in ("pd", "pd-l3", "cpd-static", "cpd"):
        t = time.perf_counter()
        p = run_point(e, cfg, q, seed)
        keep = {k: p.get(k) for k in ("goodput", "requests", "warmup_s", "ttft_s", "ttft_cold_s", "tpot_s", "pool_share", "busy_fraction", "cold_fraction")}
        print(json.dumps({"cfg": cfg, "q": q, "seed": seed, "ttft": ttft, **keep, "wall_s": round(time.perf_counter() - t)}), flush=True)
