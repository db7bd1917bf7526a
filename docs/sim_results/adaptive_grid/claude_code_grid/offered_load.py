"""Requests a Claude Code point offers in its steady window, per replay setting (no simulation): the
trace is converted exactly as a point of the grid converts it (cpd.sim.experiment.make_workload).
Run from the repository root: PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/claude_code_grid/offered_load.py"""
import sys
import numpy as np
from cpd.sim.experiment import load_experiment, make_workload, with_overrides
sys.path.insert(0, "benchmarks")
from adaptive_grid import TRACE_WORKLOADS
base = load_experiment("docs/sim_results/adaptive_grid/decode2_short.experiment.json")
for ts, idle, ramp, steady, q in [(1, 60, 5, 40, 0.73), (1, 60, 5, 40, 2.3), (1, 60, 60, 60, 2.0), (4, 20, 60, 60, 2.0), (4, 20, 60, 60, 4.0), (4, 20, 120, 60, 2.0), (1, 5, 60, 60, 4.0), (10, 60, 60, 40, 3.0)]:
    e = with_overrides(base, {"ramp_s": ramp, "steady_s": steady})
    e["workload"] = dict(TRACE_WORKLOADS["claude-code"], max_output_tokens=100, time_scale=ts, max_idle_s=idle)
    reqs, _ = make_workload(e, q * 16, 1)
    a = np.array([r.arrival_s for r in reqs])
    win = a[(a >= ramp) & (a < ramp + steady)]
    h = np.histogram(win, bins=4, range=(ramp, ramp + steady))[0] / (steady / 4)
    plen = np.array([len(r.prompt) if hasattr(r, 'prompt') else 0 for r in reqs])
    print(f"time_scale {ts} idle {idle} ramp {ramp} steady {steady} nominal {q} QPS/GPU ({q*16:.1f} QPS): {len(reqs)} requests, "
          f"{len(win)} in window = {len(win)/steady/16:.3f} QPS/GPU; window rate by quarter {np.round(h/16, 3)}", flush=True)
