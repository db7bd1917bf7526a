"""Per-request split of one point's misses (TTFT vs TPOT), with each request's routing decision
(reason, candidates' estimates) and every decode step (time, duration, batch size), for the agent
cell cold / TTFT 2 s / output 100 of ``reference_b200`` with the quick windows of
``benchmarks/adaptive_grid.py``. Run from the repository root (or a snapshot of it):

    PYTHONPATH=. nice -n 10 .venv/bin/python docs/sim_results/adaptive_grid/medium_work/split_misses.py \
        CONFIG QPS_PER_GPU SEED [HEAVY_UNCACHED_S] --out FILE.json

Prints the counts of TTFT and TPOT misses; FILE.json holds the summary, one row per request of
the steady window and the decode steps.
"""
import argparse
import collections
import json
import sys

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import adaptive_grid as G  # noqa: E402
import cpd.sim.engine_sim as ES  # noqa: E402
from cpd.sim.experiment import (build_cluster, load_experiment, make_workload, num_gpus, slo_of,  # noqa: E402
                                summarise, with_overrides)


def experiment(cold: float, heavy: float | None) -> dict:
    base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
    e = G.cell_experiment(base, {"workload": "agent", "cold": cold, "ttft_s": 2.0, "output": 100})
    return with_overrides(e, {"routing.heavy_uncached_s": heavy}) if heavy is not None else e


def run(e: dict, cfg: str, q: float, seed: int):
    """Simulate one point, keeping every routing decision and every decode step."""
    cl = build_cluster(e, cfg)
    reqs, pre = make_workload(e, q * num_gpus(cl), seed)
    decs: dict[int, object] = {}
    cur: dict[str, object] = {}
    orig_route, orig_arrive, orig_kick = ES.route, ES.EngineSimulator._arrive, ES.EngineSimulator._kick

    def route(*a, **k):
        cur["d"] = orig_route(*a, **k)
        return cur["d"]

    def arrive(self, now, i, released=False):
        cur.clear()
        orig_arrive(self, now, i, released)
        if "d" in cur:
            decs[i] = cur["d"]
    steps = collections.defaultdict(list)

    def kick(self, now, w):
        before = w.busy_s
        orig_kick(self, now, w)
        if w.role == ES.Role.DECODE and w.busy_s > before:
            steps[w.wid].append((now, w.busy_s - before, w.engine.load_stats()["running_requests"]))
    ES.route, ES.EngineSimulator._arrive, ES.EngineSimulator._kick = route, arrive, kick
    try:
        sim = ES.EngineSimulator(cl, reqs, stop_s=e["ramp_s"] + e["steady_s"] + e["drain_s"], prewarm=pre)
        sim.run()
    finally:
        ES.route, ES.EngineSimulator._arrive, ES.EngineSimulator._kick = orig_route, orig_arrive, orig_kick
    return sim, decs, steps


def rows_of(e: dict, sim, decs: dict, t_warm: float) -> list[dict]:
    slo, t1 = slo_of(e), e["ramp_s"] + e["steady_s"]
    out = []
    for i, r in enumerate(sim.rec):
        if r is None or not t_warm <= r["arrival"] < t1:
            continue
        q, d = sim.reqs[i], decs.get(i)
        ttft = (r["ttft_t"] if r["ttft_t"] is not None else sim.now) - r["arrival"]
        tpot = ((r["done_t"] - r["ttft_t"]) / (q.output_tokens - 1) if r["done_t"] and r["ttft_t"] and q.output_tokens > 1
                else None)  # one output token: no TPOT
        out.append({"i": i, "arrival_s": round(r["arrival"], 3), "prompt_tokens": q.prompt_tokens, "cls": r["cls"],
                    "pool": r["pool"], "worker": r["worker"], "decode": r["decode"], "own_s": round(r["est_s"], 3),
                    "ttft_s": round(ttft, 3), "tpot_s": round(tpot, 4) if tpot else None,
                    "miss_ttft": ttft > slo["ttft_s"], "miss_tpot": tpot is None or tpot > slo["tpot_s"],
                    "reason": str(d.reason) if d else None,
                    "predicted_ttft_s": round(d.estimated_ttft_s, 3) if d else None,
                    "candidates": [(c.worker_id, round(c.wait_s, 3), round(c.own_s, 3)) for c in d.candidates] if d else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("qps_per_gpu", type=float)
    ap.add_argument("seed", type=int)
    ap.add_argument("heavy_uncached_s", type=float, nargs="?")
    ap.add_argument("--cold", type=float, default=0.03)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    e = experiment(a.cold, a.heavy_uncached_s)
    sim, decs, steps = run(e, a.config, a.qps_per_gpu, a.seed)
    t1 = e["ramp_s"] + e["steady_s"]
    summ = summarise(sim, e, e["ramp_s"], t1, {}, {w.wid: w.busy_s for w in sim.insts})
    rows = rows_of(e, sim, decs, summ["warmup_s"])
    with open(a.out, "w") as f:
        json.dump({"config": a.config, "qps_per_gpu": a.qps_per_gpu, "seed": a.seed, "heavy_uncached_s": a.heavy_uncached_s,
                   "summary": summ, "rows": rows, "decode_steps": steps}, f)
    mt, mp = sum(r["miss_ttft"] for r in rows), sum(r["miss_tpot"] for r in rows)
    both = sum(r["miss_ttft"] and r["miss_tpot"] for r in rows)
    print(a.config, a.qps_per_gpu, a.seed, "requests", len(rows), "goodput", summ["goodput"],
          "ttft misses", mt, "tpot misses", mp, "both", both)


if __name__ == "__main__":
    main()
