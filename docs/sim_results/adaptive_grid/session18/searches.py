"""Session 18 (issue 11): saturation searches of every configuration with the router's prefill cost
in the architecture's shape. Run from the repository root:
PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/session18/searches.py LABEL OUT.jsonl SPEC...
SPEC = wl:ttft:out:seed[:cfg,cfg...] (wl: cc | mc | agentCOLD; cfg default: cpd,pd,pd-l3,cpd-static).
Agent cells: reference_b200 with the grid's QUICK_EXP windows (5 s ramp + 20 s, loads 0.4/0.8/1.2,
one bisection step); cc / mc: the grid's trace experiments (as session 17's probe.py).
Env ROUTER_COST: another router_cost for every cell (e.g. linear-flat: the session-17 records' one);
QUEUE_REMAINING=1: queue sums count a started prefill's remaining estimate (experiment "queue_remaining")."""
import json, os, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation

CC = "docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json"
MC = "docs/sim_results/adaptive_grid/decode2_short.experiment.json"
CONFIGS = ("cpd", "pd", "pd-l3", "cpd-static")


def exp_of(wl, ttft, out):
    if wl in ("cc", "mc"):
        base = load_experiment(CC if wl == "cc" else MC)
        cell = {"workload": "claude-code" if wl == "cc" else "mooncake", "cold": None}
    else:
        base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
        cell = {"workload": "agent", "cold": float(wl[5:])}
    if os.environ.get("ROUTER_COST"):
        base = with_overrides(base, {"router_cost": os.environ["ROUTER_COST"]})
    if os.environ.get("QUEUE_REMAINING") == "1":
        base = with_overrides(base, {"queue_remaining": True})
    return G.cell_experiment(base, {**cell, "ttft_s": ttft, "output": out})


def main():
    label, out = sys.argv[1], sys.argv[2]
    for spec in sys.argv[3:]:
        parts = spec.split(":")
        wl, ttft, o, seed = parts[0], float(parts[1]), int(parts[2]), int(parts[3])
        for cfg in (parts[4].split(",") if len(parts) > 4 else CONFIGS):
            t = time.perf_counter()
            r = search_saturation(exp_of(wl, ttft, o), cfg, seed)
            row = {"label": label, "spec": ":".join(parts[:4]), "cfg": cfg, "sat": r["qps_per_gpu"],
                   "points": [(x["qps_per_gpu"], x["goodput"], x["requests"]) for x in r["points"]],
                   "router_cost": os.environ.get("ROUTER_COST", "experiment's"),
                   "queue_remaining": os.environ.get("QUEUE_REMAINING") == "1",
                   "wall_s": round(time.perf_counter() - t, 1), "end_utc": time.strftime("%H:%M:%S", time.gmtime())}
            print(json.dumps(row), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


main()
