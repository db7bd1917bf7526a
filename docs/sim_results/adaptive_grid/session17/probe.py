"""Rule A3 candidates (session 17): cpd saturation searches or single points with the policy patched.
Run from the repository root:
PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/session17/probe.py CAND OUT.jsonl SPEC...
SPEC = wl:ttft:out:seed:q[:cfg] (wl: cc | mc | agentCOLD; q < 0: saturation search).
CAND: head / fix / d933aa1 (labels of the working tree's code, no patch, run on a21ba29 / 0bb9cf6 with
QUEUE_RESOLUTION_S / d933aa1 with factor 2) | [fix]factorX (HOPELESS_WAIT_FACTOR = X; "fix": on 0bb9cf6)
| rc-KIND (agent cells: router_cost KIND, a diagnosis).
Env STEADY_S / SEARCH_ITERS (agent cells): another steady window and bisection steps."""
import collections, json, os, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
import cpd.policy.routing as R
from cpd.sim.experiment import load_experiment, run_point, with_overrides
from cpd.sim.sweep import search_saturation

CC = "docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json"
MC = "docs/sim_results/adaptive_grid/decode2_short.experiment.json"
STATS = collections.Counter()
ROUTER_COST = [None]
_choose = R._choose_prefill_side


def counted(cands, heavy, cfg):
    win, reason, fb = _choose(cands, heavy, cfg)
    STATS[str(reason)] += 1
    return win, reason, fb


R._choose_prefill_side = counted


def apply(cand):
    if "factor" in cand:
        R.HOPELESS_WAIT_FACTOR = float(cand.split("factor")[1])
    elif cand.startswith("rc-"):  # diagnosis only: the router prices with another cost model
        ROUTER_COST[0] = cand[3:]
    elif cand not in ("head", "fix", "d933aa1"):
        raise SystemExit(f"unknown candidate {cand}")


def exp_of(wl, ttft, out):
    if wl in ("cc", "mc"):
        return G.cell_experiment(load_experiment(CC if wl == "cc" else MC),
                                 {"workload": "claude-code" if wl == "cc" else "mooncake", "cold": None,
                                  "ttft_s": ttft, "output": out})
    base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
    if os.environ.get("STEADY_S"):  # a longer steady window / finer search than the grid's quick one
        base = with_overrides(base, {"steady_s": float(os.environ["STEADY_S"]),
                                     "search.iters": int(os.environ.get("SEARCH_ITERS", "1"))})
    if ROUTER_COST[0]:
        base = with_overrides(base, {"router_cost": ROUTER_COST[0]})
    return G.cell_experiment(base, {"workload": "agent", "cold": float(wl[5:]), "ttft_s": ttft, "output": out})


def main():
    cand, out = sys.argv[1], sys.argv[2]
    apply(cand)
    for spec in sys.argv[3:]:
        parts = spec.split(":")
        wl, ttft, o, seed, q = parts[0], float(parts[1]), int(parts[2]), int(parts[3]), float(parts[4])
        cfg = parts[5] if len(parts) > 5 else "cpd"
        STATS.clear(); t = time.perf_counter()
        if q < 0:
            r = search_saturation(exp_of(wl, ttft, o), cfg, seed)
            row = {"sat": r["qps_per_gpu"], "points": [(x["qps_per_gpu"], x["goodput"], x["requests"]) for x in r["points"]]}
        else:
            p = run_point(exp_of(wl, ttft, o), cfg, q, seed)
            row = {"goodput": p["goodput"], "requests": p["requests"], "busy": p["busy_fraction"]}
        row = {"cand": cand, "spec": spec, "cfg": cfg, **row, "decisions": dict(STATS),
               "wall_s": round(time.perf_counter() - t, 1), "end_utc": time.strftime("%H:%M:%S", time.gmtime())}
        print(json.dumps(row), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


main()
