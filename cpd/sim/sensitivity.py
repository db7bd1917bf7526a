"""Sensitivity study: which modelling assumption drives the CPD-vs-P/D gain.

Each *row* changes one or more experiment keys (dotted paths, e.g. ``prefill.l2_bytes``,
``workload.cold_fraction``, ``slo.ttft_p90_s``) from the experiment file, re-runs the
sweep of the chosen configurations and reports their saturation QPS/GPU and the gains.
Rows that differ only in the SLO share one sweep (the SLO only enters the saturation rule).
Deterministic, like every sweep: the same inputs give the same table.

    python -m cpd.sim.sensitivity reference_b200 --out docs/sim_results --steady-s 300

writes ``sensitivity.json`` and ``sensitivity.md`` (the table; the prose around it lives in
``docs/sim_results/report.md``).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from cpd.sim.experiment import load_experiment, saturation
from cpd.sim.sweep import run_sweep

TB = 1e12

# (label, overrides). The first row is the experiment file as shipped.
DEFAULT_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("reference (as shipped: live-router cost, L2 3 TB, p90 <= 1 s)", {}),
    ("previous reference (roofline router cost, L2 1.5 TB, p90 <= 2 s)",
     {"router_cost": "roofline", "prefill.l2_bytes": 1.5 * TB, "slo.ttft_p90_s": 2.0}),
    ("router prices queues with the roofline", {"router_cost": "roofline"}),
    ("L2 host DRAM 1.5 TB / prefill node", {"prefill.l2_bytes": 1.5 * TB}),
    ("L2 host DRAM 2 TB / prefill node", {"prefill.l2_bytes": 2 * TB}),
    ("no L2 (HBM prefix cache only)", {"prefill.l2_bytes": 0}),
    ("TTFT SLO p90 <= 2 s", {"slo.ttft_p90_s": 2.0}),
    ("TTFT SLO p90 <= 0.5 s", {"slo.ttft_p90_s": 0.5}),
    ("new sessions 50 K tokens (cold prefill ~0.4 s)", {"workload.first_context": 50_000}),
    ("cold-fraction knob 0 (compaction only)", {"workload.cold_fraction": 0.0}),
    ("cold-fraction knob 0.06", {"workload.cold_fraction": 0.06}),
    ("output 400 tokens", {"workload.output_tokens": 400}),
]


def apply_overrides(exp: dict, overrides: dict[str, Any]) -> dict:
    """A deep copy of ``exp`` with dotted-path keys set."""
    e = copy.deepcopy(exp)
    for k, v in overrides.items():
        d = e
        parts = k.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return e


def run_sensitivity(exp: dict, rows=None, configs=("2P1D", "CPD-1D", "2P1D+L3"), steady_s: float | None = None,
                    jobs: int = 2, progress: bool = True, baseline: str = "2P1D", cpd: str = "CPD-1D",
                    pooled: str = "2P1D+L3") -> dict[str, Any]:
    rows = rows if rows is not None else DEFAULT_ROWS
    cache: dict[str, dict] = {}
    out = []
    for label, ov in rows:
        e = apply_overrides(exp, ov)
        if steady_s is not None:
            e["steady_s"] = steady_s
        slo = e.get("slo", {})
        key = json.dumps({k: v for k, v in ov.items() if not k.startswith("slo.")}, sort_keys=True)
        if key not in cache:
            cache[key] = run_sweep(e, list(configs), progress=progress, jobs=jobs)
        res = cache[key]
        p90, mc = slo.get("ttft_p90_s", 2.0), slo.get("min_completion_ratio", 0.98)
        sat = {c: saturation([p for p in res["points"] if p["config"] == c], p90, mc) for c in configs}
        q = {c: sat[c]["qps_per_gpu"] for c in configs}

        def gain(a, b):
            return round(q[a] / q[b] - 1, 4) if (q.get(a) and q.get(b)) else None
        pts = [p for p in res["points"] if p["config"] == baseline]
        out.append({"label": label, "overrides": ov, "saturation": sat, "qps_per_gpu": q,
                    "at_least": {c: sat[c]["bounded"] == "at-least" for c in configs},
                    "gain_cpd_vs_baseline": gain(cpd, baseline), "gain_cpd_vs_pooled": gain(cpd, pooled),
                    "realised_cold_fraction": round(sum(p["cold_fraction"] for p in pts) / max(1, len(pts)), 3)})
    return {"experiment": exp.get("name", ""), "configs": list(configs), "baseline": baseline, "cpd": cpd,
            "pooled": pooled, "steady_s": steady_s or exp.get("steady_s"), "qps_per_gpu": exp["qps_per_gpu"],
            "rows": out}


def markdown_table(s: dict) -> str:
    b, c, p = s["baseline"], s["cpd"], s["pooled"]

    def f(r, k):
        v = r["qps_per_gpu"].get(k)
        if v is None:
            return f"< {min(s['qps_per_gpu'])}"
        return (">= " if r["at_least"].get(k) else "") + f"{v:.2f}"

    def g(v):
        return "n/a" if v is None else f"{v * 100:+.0f} %"
    lines = [f"| assumption (one change from the reference) | realised cold | {b} | {c} | {p} | {c} vs {b} | "
             f"{c} vs {p} |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        lines.append(f"| {r['label']} | {r['realised_cold_fraction']:.2f} | {f(r, b)} | {f(r, c)} | {f(r, p)} | "
                     f"{g(r['gain_cpd_vs_baseline'])} | {g(r['gain_cpd_vs_pooled'])} |")
    return "\n".join(lines) + "\n"


def render(s: dict, args: str, experiment: str = "reference_b200") -> str:
    """``sensitivity.md``: the table with how to regenerate and read it."""
    return (f"# Sensitivity of the CPD gain ({s['experiment']}, steady window {s['steady_s']:.0f} s per point)\n\n"
            f"Regenerate: `.venv/bin/python -m cpd.sim.sensitivity {experiment} {args}` (deterministic).\n\n"
            "Saturation QPS/GPU by the report's rule (TTFT p90 <= SLO, first-token completion >= 0.98, "
            "interpolated), one assumption changed per row from the experiment file. `< x`: misses the SLO "
            "at the lowest load; `>= x`: meets it at the highest. *Realised cold* is the router-classified "
            f"cold share averaged over the {s['baseline']} points (it grows where {s['baseline']} is overloaded: "
            "fewer sessions are idle for a next turn, so more new sessions start). "
            f"Shorter windows than the reference's make {s['cpd']}'s crossing earlier; the interpretation is in "
            "docs/simulator.md (\"Reference experiment\").\n\n" + markdown_table(s))


def main(argv: list[str] | None = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("experiment", nargs="?", default="reference_b200")
    ap.add_argument("--out", default="sim_out")
    ap.add_argument("--steady-s", type=float, default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    exp = load_experiment(a.experiment)
    s = run_sensitivity(exp, steady_s=a.steady_s, jobs=a.jobs, progress=not a.no_progress)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sensitivity.json").write_text(json.dumps(s, sort_keys=True, indent=1) + "\n")
    md = render(s, f"--out {a.out}" + (f" --steady-s {a.steady_s:g}" if a.steady_s else ""), a.experiment)
    (out / "sensitivity.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
