"""Per-request routing of one point of a trace cell (``decode2_short``, as ``trace_saturation_one.py``),
for comparing two heavy thresholds request by request: each steady-window request with its class,
pool, reason, own work and TTFT (``../medium_work/split_misses.py``'s rows). Run from the
repository root (or a snapshot of it):

    PYTHONPATH=. nice -n 10 .venv/bin/python docs/sim_results/adaptive_grid/mooncake_heavy_quarter/trace_split.py \
        WORKLOAD CONFIG QPS_PER_GPU SEED TTFT_S [HEAVY_UNCACHED_S] --out FILE.json
"""
import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "medium_work"))
import adaptive_grid as G  # noqa: E402
import split_misses as S  # noqa: E402
from cpd.sim.experiment import load_experiment, summarise, with_overrides  # noqa: E402

EXPERIMENT = "docs/sim_results/adaptive_grid/decode2_short.experiment.json"


def _one_token(sim) -> None:
    """A trace request with one output token has no TPOT; count its time after the first token over
    one token (rows_of divides by ``output_tokens - 1``), so it never misses on TPOT."""
    for q in sim.reqs:
        if q.output_tokens < 2:
            object.__setattr__(q, "output_tokens", 2)  # after the run: only the rows read it


def main() -> None:
    ap = argparse.ArgumentParser()
    for k in ("workload", "config"):
        ap.add_argument(k)
    ap.add_argument("qps_per_gpu", type=float)
    ap.add_argument("seed", type=int)
    ap.add_argument("ttft_s", type=float)
    ap.add_argument("heavy_uncached_s", type=float, nargs="?")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    e = G.cell_experiment(load_experiment(EXPERIMENT), {"workload": a.workload, "cold": None, "ttft_s": a.ttft_s,
                                                        "output": 100})
    if a.heavy_uncached_s is not None:
        e = with_overrides(e, {"routing.heavy_uncached_s": a.heavy_uncached_s})
    sim, decs, _ = S.run(e, a.config, a.qps_per_gpu, a.seed)
    _one_token(sim)
    t1 = e["ramp_s"] + e["steady_s"]
    summ = summarise(sim, e, e["ramp_s"], t1, {}, {w.wid: w.busy_s for w in sim.insts})
    rows = S.rows_of(e, sim, decs, summ["warmup_s"])  # trace requests with one output token: see _one_token
    with open(a.out, "w") as f:
        json.dump({"workload": a.workload, "config": a.config, "qps_per_gpu": a.qps_per_gpu, "seed": a.seed,
                   "heavy_uncached_s": a.heavy_uncached_s, "summary": summ, "rows": rows}, f)
    by = collections.Counter((r["cls"], r["pool"], r["reason"]) for r in rows)
    print(a.config, a.qps_per_gpu, a.seed, a.heavy_uncached_s, "requests", len(rows), "goodput", summ["goodput"],
          "ttft misses", sum(r["miss_ttft"] for r in rows), "tpot misses", sum(r["miss_tpot"] for r in rows))
    for k, n in sorted(by.items(), key=lambda kv: -kv[1]):
        print("  ", k, n)


if __name__ == "__main__":
    main()
