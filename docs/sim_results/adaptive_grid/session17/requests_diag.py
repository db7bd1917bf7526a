"""Per-request diagnosis of one agent point (reference_b200, quick windows): every request of the
steady window with its routing decision (class, pool, reason, the candidates' wait/own estimates and
the short arrival rate the policy saw), its TTFT and whether it met the SLO. Run from the
repository root:
PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/session17/requests_diag.py \
    OUT.jsonl COLD TTFT OUTPUT SEED QPS_PER_GPU CONFIG...
Env STEADY_S: another steady window; ROUTER_COST=KIND: another router cost model (a diagnosis); HOPELESS_WAIT_FACTOR=X: that factor. Writes one summary line per config and one line per window request (``"req"`` rows)."""
import json, os, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
import cpd.sim.engine_sim as ES
from cpd.sim.experiment import (build_cluster, load_experiment, make_workload, num_gpus, summarise,
                                with_overrides, _busy_by_role)

if os.environ.get("HOPELESS_WAIT_FACTOR"):  # a candidate (probe.py's factorX)
    import cpd.policy.routing as R
    R.HOPELESS_WAIT_FACTOR = float(os.environ["HOPELESS_WAIT_FACTOR"])
DECISIONS: dict = {}
_route = ES.route


def route_logged(n, match, loads, cfg, cost):
    d = _route(n, match, loads, cfg, cost)
    DECISIONS[CURRENT[0]] = (d, {w.worker_id: round(w.short_arrivals_per_s, 2) for w in loads})
    return d


CURRENT = [None]
_arrive = ES.EngineSimulator._arrive


def arrive_logged(self, now, i, released=False):
    CURRENT[0] = i
    return _arrive(self, now, i, released)


ES.route = route_logged
ES.EngineSimulator._arrive = arrive_logged


def point(exp, config, q, seed):
    DECISIONS.clear()
    cluster = build_cluster(exp, config)
    total = q * num_gpus(cluster)
    reqs, prewarm = make_workload(exp, total, seed)
    ramp, steady = float(exp["ramp_s"]), float(exp["steady_s"])
    t1 = ramp + steady
    sim = ES.EngineSimulator(cluster, reqs, stop_s=t1 + exp.get("drain_s", 60), prewarm=prewarm)
    snaps = {}
    sim.at(ramp, lambda now: snaps.__setitem__("a", _busy_by_role(sim)))
    sim.at(t1, lambda now: snaps.__setitem__("b", _busy_by_role(sim)))
    sim.run()
    s = summarise(sim, exp, ramp, t1, snaps["a"], snaps.get("b", _busy_by_role(sim)))
    slo = exp["slo"]["ttft_s"]
    rows = []
    for i, r in enumerate(sim.rec):
        if r is None or not (s["warmup_s"] <= r["arrival"] < t1):
            continue
        d, rates = DECISIONS[i]
        ttft = (r["ttft_t"] if r["ttft_t"] is not None else sim.now) - r["arrival"]
        tpot = None
        if r["done_t"] is not None and r["ttft_t"] is not None and reqs[i].output_tokens > 1:
            tpot = (r["done_t"] - r["ttft_t"]) / (reqs[i].output_tokens - 1)
        rows.append({"i": i, "arrival": round(r["arrival"], 3), "prompt": reqs[i].prompt_tokens, "cls": r["cls"],
                     "pool": r["pool"], "worker": r["worker"], "reason": str(d.reason),
                     "est_ttft": round(d.estimated_ttft_s, 3), "ttft": round(ttft, 3),
                     "tpot": None if tpot is None else round(tpot, 4), "met_ttft": ttft <= slo,
                     "cands": [(c.worker_id, str(c.role), round(c.wait_s, 3), round(c.own_s, 3)) for c in d.candidates],
                     "short_rate": rates})
    return s, rows


def main():
    out, cold, ttft, o, seed, q = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
    base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
    if os.environ.get("STEADY_S"):  # a longer steady window than the grid's quick one
        base = with_overrides(base, {"steady_s": float(os.environ["STEADY_S"])})
    if os.environ.get("ROUTER_COST"):  # diagnosis: the router prices with another cost model
        base = with_overrides(base, {"router_cost": os.environ["ROUTER_COST"]})
    exp = G.cell_experiment(base, {"workload": "agent", "cold": cold, "ttft_s": ttft, "output": o})
    with open(out, "a") as f:
        for config in sys.argv[7:]:
            t = time.perf_counter()
            s, rows = point(exp, config, q, seed)
            head = {"config": config, "cold": cold, "ttft_s": ttft, "output": o, "seed": seed, "qps_per_gpu": q,
                    "goodput": s["goodput"], "requests": s["requests"], "warmup_s": s["warmup_s"],
                    "busy_fraction": s["busy_fraction"], "missed": sum(not r["met_ttft"] for r in rows),
                    "wall_s": round(time.perf_counter() - t, 1)}
            print(json.dumps(head), flush=True)
            f.write(json.dumps(head) + "\n")
            for r in rows:
                f.write(json.dumps({"config": config, "qps_per_gpu": q, "req": r}) + "\n")


main()
