"""One trace or agent cell of ``benchmarks/adaptive_grid.py``, searched one (seed, configuration) at a
time so that an interrupted run keeps every finished search: each saturation search
(:func:`cpd.sim.sweep.search_saturation`, the grid's own) appends one JSON line to OUT, and a rerun
skips the lines already there. Seeds run in order, all four configurations per seed, so every
finished seed gives a ratio. ``--table`` prints the per-seed ratios adaptive / best other with
their mean and 95 % t-interval. Every simulated point is also appended, whole, to OUT's
``.points.jsonl`` sibling (with its wall time, the process's peak RSS and the load average); a rerun
takes a point already there instead of simulating it again (a point is deterministic: same inputs,
same dict), so a search killed halfway resumes from its last finished point. Run from the repository root (or a snapshot of it):

    PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/claude_code_grid/cell_searches.py \
        EXPERIMENT WORKLOAD TTFT_S OUTPUT_TOKENS --seeds 3 --out FILE.jsonl [--table]
"""
import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import adaptive_grid as G  # noqa: E402
from cpd.sim.experiment import load_experiment  # noqa: E402
from cpd.sim.stats import mean_ci  # noqa: E402
import cpd.sim.sweep as sweep  # noqa: E402
from cpd.sim.sweep import search_saturation  # noqa: E402

CONFIGS = (*G.OTHERS, G.ADAPTIVE)


def done_lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []


def table(rows: list[dict], key: tuple) -> str:
    """Per seed: each configuration's saturation and adaptive / best other; then the mean [95 % t-CI]."""
    sat = {(r["seed"], r["cfg"]): r for r in rows if tuple(r["cell"]) == key}
    seeds = sorted({s for s, _ in sat})
    lines = ["| seed | " + " | ".join(CONFIGS) + " | best other | ratio |", "|---:|" + "---:|" * len(CONFIGS) + "---|---:|"]
    ratios = []
    for s in seeds:
        if not all((s, c) in sat for c in CONFIGS):
            continue
        v = {c: sat[(s, c)]["sat"] for c in CONFIGS}
        cap = {c: sat[(s, c)]["at_least"] for c in CONFIGS}
        best = max(G.OTHERS, key=lambda c: v[c] or 0.0)
        ratios.append(v[G.ADAPTIVE] / v[best] if v[best] else None)
        cells = [("≥ " if cap[c] else "") + f"{v[c]:.4f}" for c in CONFIGS]
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {best} | {ratios[-1]:.3f} |")
    ci = mean_ci(ratios)
    if ci["mean"] is not None:
        lines.append(f"\nratio mean {ci['mean']:.3f} [{ci['lo']:.3f}, {ci['hi']:.3f}] over {len(ratios)} seeds")
    return "\n".join(lines)


def memo_points(points: Path, key: tuple) -> None:
    """Route the search's ``run_point`` through POINTS: a point already there (same cell, seed,
    configuration, load) is read back, a new one is simulated and appended with its wall time."""
    have = {(r["seed"], r["config"], r["qps_per_gpu"]): r["point"] for r in done_lines(points)
            if tuple(r["cell"]) == key}
    run = sweep.run_point

    def point(exp, config, q, seed=None, overrides=None):
        k = (seed, config, round(q, 4))
        if k in have:
            return have[k]
        t = time.perf_counter()
        p = run(exp, config, q, seed, overrides)
        row = {"cell": list(key), "seed": seed, "config": config, "qps_per_gpu": round(q, 4), "point": p,
               "wall_s": round(time.perf_counter() - t, 1), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
               "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "end_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with points.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in row if k != "point"} | {"goodput": p["goodput"]}), file=sys.stderr, flush=True)
        return p
    sweep.run_point = point


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("experiment")
    ap.add_argument("workload")
    ap.add_argument("ttft_s", type=float)
    ap.add_argument("output", type=int)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only-seeds", default="", help="comma-separated seeds to run (default: 1..--seeds)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--table", action="store_true")
    a = ap.parse_args()
    out, key = Path(a.out), (a.workload, a.ttft_s, a.output)
    if a.table:
        print(table(done_lines(out), key))
        return
    cold = None if a.workload != "agent" else 0.0
    e = G.cell_experiment(load_experiment(a.experiment), {"workload": a.workload, "cold": cold, "ttft_s": a.ttft_s,
                                                          "output": a.output})
    have = {(r["seed"], r["cfg"]) for r in done_lines(out) if tuple(r["cell"]) == key}
    memo_points(out.with_suffix(".points.jsonl"), key)
    seeds = [int(x) for x in a.only_seeds.split(",")] if a.only_seeds else range(1, a.seeds + 1)
    for seed in seeds:
        for cfg in CONFIGS:
            if (seed, cfg) in have:
                continue
            t = time.perf_counter()
            r = search_saturation(e, cfg, seed)
            row = {"cell": list(key), "seed": seed, "cfg": cfg, "sat": r["qps_per_gpu"], "at_least": r.get("bounded") == "at-least",
                   "pts": [(p["qps_per_gpu"], p["goodput"]) for p in r["points"]],
                   "wall_s": round(time.perf_counter() - t), "loadavg_1_5_15_end": [round(x, 2) for x in os.getloadavg()],
                   "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
