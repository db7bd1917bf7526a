"""Session 19: adaptive cpd searches with queue_remaining off (the default again since 159e59e) at the output-100 agent seeds the grid (queue_remaining on) missed. Run from the repository root: PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/session19/ab_queue_remaining_off.py COLD:TTFT:OUT:SEED ..."""
import sys, json, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation
for spec in sys.argv[1:]:
    cold, ttft, out, seed = spec.split(":"); cold, ttft, out, seed = float(cold), float(ttft), int(out), int(seed)
    base = with_overrides(load_experiment("reference_b200"), {**G.QUICK_EXP, "queue_remaining": False})
    e = G.cell_experiment(base, {"workload": "agent", "cold": cold, "ttft_s": ttft, "output": out})
    t = time.time(); r = search_saturation(e, "cpd", seed)
    print(json.dumps({"spec": spec, "qr": False, "cfg": "cpd", "sat": r["qps_per_gpu"], "pts": [(p["qps_per_gpu"], p["goodput"]) for p in r["points"]], "s": round(time.time()-t)}), flush=True)
