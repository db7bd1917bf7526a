"""Request by request: adaptive `cpd` vs `cpd-static` at one point of the Claude Code cell (default:
TTFT 0.5 s, output 400, seed 2, 4.0 nominal QPS/GPU, the point where adaptive misses). Both runs get
the same requests (same seed and load), so each request's pass/fail can be joined by index. Prints one
JSON line: pass/fail counts in the steady window [ramp, ramp + steady) (no MSER cut: both points used
the 60 s ramp there), the requests that pass under one and fail under the other, grouped by where
each configuration sent them (pool) and by adaptive's own-work estimate (the router's ``est_s``).
Run from the repository root (or a snapshot):

    PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/claude_code_grid/miss_requests.py [TTFT OUT SEED QPS]
"""
import collections
import json
import sys
import time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import adaptive_grid as G  # noqa: E402
from cpd.sim.experiment import build_cluster, load_experiment, make_workload, num_gpus, slo_of  # noqa: E402
from cpd.sim.engine_sim import EngineSimulator  # noqa: E402

EXP = "docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json"


def simulate(exp: dict, config: str, q: float, seed: int) -> list[dict]:
    """One point as ``run_point`` runs it; per request in the window: pass, pool, est_s, TTFT."""
    cluster = build_cluster(exp, config)
    reqs, prewarm = make_workload(exp, q * num_gpus(cluster), seed, None)
    ramp, steady = float(exp.get("ramp_s", 30)), float(exp.get("steady_s", 600))
    sim = EngineSimulator(cluster, reqs, stop_s=ramp + steady + exp.get("drain_s", 60), prewarm=prewarm)
    sim.run()
    slo, out = slo_of(exp), []
    for i, r in enumerate(sim.rec):
        if r is None or not ramp <= r["arrival"] < ramp + steady:
            continue
        q_ = sim.reqs[i]
        ttft = None if r["ttft_t"] is None else r["ttft_t"] - r["arrival"]
        tpot_ok = r["done_t"] is not None and (q_.output_tokens <= 1 or
                                               (r["done_t"] - r["ttft_t"]) / (q_.output_tokens - 1) <= slo["tpot_s"])
        out.append({"i": i, "ok": bool(ttft is not None and ttft <= slo["ttft_s"] and tpot_ok), "ttft_s": ttft,
                    "pool": r["pool"], "worker": r["worker"], "arrival_s": r["arrival"], "cls": r["cls"], "est_s": r["est_s"], "hold_s": r.get("hold_s", 0.0),
                    "prompt_tokens": q_.prompt_tokens})
    return out


def behind_medium(a: dict, s: dict, lost: list[int], before_s: float = 1.0) -> dict:
    """For each request adaptive lost: did its prefill worker (under adaptive) receive, in the
    ``before_s`` before it, a request of >= 0.25 s own work that ``cpd-static`` sent to the
    pre-prefill pool (work adaptive kept on the prefill side)?"""
    kept = [j for j in a if a[j]["est_s"] >= 0.25 and a[j]["pool"] == "prefill" and s.get(j, {}).get("pool") == "pre-prefill"]
    hit = [i for i in lost if any(a[j]["worker"] == a[i]["worker"] and
                                  0 <= a[i]["arrival_s"] - a[j]["arrival_s"] <= before_s for j in kept)]
    return {"kept_medium_on_prefill": len(kept), "kept_medium_own_work_s": round(sum(a[j]["est_s"] for j in kept), 2),
            "lost_with_kept_medium_before_on_same_worker": len(hit), "lost": len(lost), "before_s": before_s,
            "lost_by_worker": dict(sorted(collections.Counter(a[i]["worker"] for i in lost).items()))}


def est_bin(s: float) -> str:
    return "<0.1" if s < 0.1 else "0.1-0.25" if s < 0.25 else "0.25-0.5" if s < 0.5 else ">=0.5"


def main() -> None:
    ttft, output, seed, q = (float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])) \
        if len(sys.argv) > 4 else (0.5, 400, 2, 4.0)
    exp = G.cell_experiment(load_experiment(EXP), {"workload": "claude-code", "cold": None, "ttft_s": ttft,
                                                   "output": output})
    t = time.perf_counter()
    a = {r["i"]: r for r in simulate(exp, "cpd", q, seed)}
    s = {r["i"]: r for r in simulate(exp, "cpd-static", q, seed)}
    both = sorted(set(a) & set(s))
    def group(rows, key):
        return dict(sorted(collections.Counter(key(r) for r in rows).items()))
    lost = [i for i in both if s[i]["ok"] and not a[i]["ok"]]    # static passes, adaptive fails
    won = [i for i in both if a[i]["ok"] and not s[i]["ok"]]
    rep = {"cell": ["claude-code", ttft, output], "seed": seed, "qps_per_gpu": q, "window_requests": len(both),
           "only_in_one_window": len(set(a) ^ set(s)),
           "fails": {"cpd": sum(not a[i]["ok"] for i in both), "cpd-static": sum(not s[i]["ok"] for i in both)},
           "fails_by_pool": {"cpd": group([a[i] for i in both if not a[i]["ok"]], lambda r: r["pool"]),
                             "cpd-static": group([s[i] for i in both if not s[i]["ok"]], lambda r: r["pool"])},
           "fails_by_cpd_est_s": {"cpd": group([a[i] for i in both if not a[i]["ok"]], lambda r: est_bin(r["est_s"])),
                                  "cpd-static": group([s[i] for i in both if not s[i]["ok"]], lambda r: est_bin(a[r["i"]]["est_s"]))},
           "adaptive_lost": {"n": len(lost),
                             "pools_cpd_vs_static": group(lost, lambda i: f'{a[i]["pool"]} / {s[i]["pool"]}'),
                             "cpd_est_s": group(lost, lambda i: est_bin(a[i]["est_s"])),
                             "cpd_ttft_s_p50": sorted(a[i]["ttft_s"] or 1e9 for i in lost)[len(lost) // 2] if lost else None,
                             "held_for_l3": sum(a[i]["hold_s"] > 0 for i in lost)},
           "adaptive_won": {"n": len(won),
                            "pools_cpd_vs_static": group(won, lambda i: f'{a[i]["pool"]} / {s[i]["pool"]}'),
                            "cpd_est_s": group(won, lambda i: est_bin(a[i]["est_s"]))},
           "adaptive_lost_behind_medium": behind_medium(a, s, lost),
           "prefill_pool_own_work_s": {"cpd": round(sum(a[i]["est_s"] for i in both if a[i]["pool"] == "prefill"), 2),
                                       "cpd-static": round(sum(s[i]["est_s"] for i in both if s[i]["pool"] == "prefill"), 2)},
           "pool_counts": {"cpd": group([a[i] for i in both], lambda r: r["pool"]),
                           "cpd-static": group([s[i] for i in both], lambda r: r["pool"])},
           "wall_s": round(time.perf_counter() - t, 1)}
    print(json.dumps(rep), flush=True)


if __name__ == "__main__":
    main()
