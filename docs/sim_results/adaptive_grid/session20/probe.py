"""Session 20 probe: adaptive cpd alone (today's work tree: rule A3 prices a heavy spill by the short
requests it pushes past the SLO, draining at 1 - busy) on agent cells, one search per cell and seed.
PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/session20/probe.py OUT.jsonl COLD:TTFT:OUT:SEED ..."""
import json, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation

out = open(sys.argv[1], "a")
for spec in sys.argv[2:]:
    cold, ttft, o, seed = spec.split(":")
    base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
    e = G.cell_experiment(base, {"workload": "agent", "cold": float(cold), "ttft_s": float(ttft), "output": int(o)})
    t = time.time(); r = search_saturation(e, "cpd", int(seed))
    out.write(json.dumps({"spec": spec, "cfg": "cpd", "sat": r["qps_per_gpu"],
                          "pts": [(p["qps_per_gpu"], p["goodput"]) for p in r["points"]],
                          "wall_s": round(time.time() - t, 1)}) + "\n"); out.flush()
