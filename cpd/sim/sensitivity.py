"""Sensitivity study: which modelling assumption drives the CPD-vs-P/D gain.

Each *row* changes one or more experiment keys (dotted paths, e.g. ``prefill.l2_bytes``,
``workload.cold_fraction``, ``slo.ttft_s``) from the experiment file, re-runs the grid sweep of
the chosen configurations over the experiment's seeds and reports each configuration's
saturation QPS/GPU (mean over seeds, 95 % t-interval) and the gains of the mean saturations.
Deterministic, like every sweep: the same inputs give the same table.

    python -m cpd.sim.sensitivity reference_b200 --out docs/sim_results --steady-s 120 --seeds 3

writes ``sensitivity.json`` and ``sensitivity.md`` (the table; the prose around it lives in
``docs/sim_results/report.md``); each finished row is kept in ``OUT/rows/`` and read back by a rerun
with the same inputs (a study stopped part-way, e.g. by the kernel's OOM killer, resumes).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cpd.sim.experiment import QUICK_WINDOWS, load_experiment, with_overrides
from cpd.sim.sweep import compare, run_sweep

TB = 1e12

# (label, overrides). The first row is the experiment file as shipped.
DEFAULT_ROWS: list[tuple[str, dict[str, Any]]] = [
    ("reference (as shipped: live-router cost, L2 3 TB, TTFT <= 1 s, TPOT <= 50 ms)", {}),
    ("router prices queues with the roofline", {"router_cost": "roofline"}),
    ("L2 host DRAM 1.5 TB / prefill node", {"prefill.l2_bytes": 1.5 * TB}),
    ("no L2 (HBM prefix cache only)", {"prefill.l2_bytes": 0}),
    ("TTFT SLO 2 s", {"slo.ttft_s": 2.0}),
    ("TTFT SLO 0.5 s", {"slo.ttft_s": 0.5}),
    ("TPOT SLO 25 ms", {"slo.tpot_s": 0.025}),
    ("new sessions 50 K tokens (cold prefill ~0.4 s)", {"workload.first_context": 50_000}),
    ("cold-fraction knob 0 (compaction only)", {"workload.cold_fraction": 0.0}),
    ("cold-fraction knob 0.08", {"workload.cold_fraction": 0.08}),
    ("output 400 tokens", {"workload.output_tokens": 400}),
]


DEFAULT_CONFIGS = ("pd", "cpd-static", "pd-l3", "cpd")


def _earlier_row(earlier: dict, label: str, overrides: dict) -> dict:
    """The row of an earlier study with this label and these overrides (an error names a mismatch)."""
    for r in earlier["rows"]:
        if r["label"] == label and r["overrides"] == overrides:
            return r
    raise ValueError(f"--earlier: no row {label!r} with overrides {overrides} in the earlier study")


def apply_overrides(exp: dict, overrides: dict[str, Any]) -> dict:
    """A deep copy of ``exp`` with dotted-path keys set (:func:`cpd.sim.experiment.with_overrides`)."""
    return with_overrides(exp, overrides)


def run_sensitivity(exp: dict, rows=None, configs=DEFAULT_CONFIGS, steady_s: float | None = None,
                    jobs: int = 2, progress: bool = True, baseline: str = "pd", cpd: str = "cpd-static",
                    pooled: str = "pd-l3", seeds: int | None = None, search: bool = False,
                    earlier: dict | None = None, cache_dir: Path | None = None) -> dict[str, Any]:
    """One row per ``rows`` entry. ``search``: each configuration's saturation by the saturation
    search (:func:`cpd.sim.sweep.compare`, the adaptive grid's rule) instead of interpolation over
    the experiment's load grid (:func:`cpd.sim.sweep.run_sweep`). ``earlier``: an earlier study's
    result (same experiment, rows and settings) whose other configurations join each row, so that
    after a change to one configuration's code only that one is run again. ``cache_dir``: each
    row's runs are kept in ``cache_dir/rows/`` as they finish and read back on a rerun with the same
    inputs (a study killed part-way resumes)."""
    rows = rows if rows is not None else DEFAULT_ROWS
    out = []
    for label, ov in rows:
        e = apply_overrides(exp, ov)
        if steady_s is not None:
            e["steady_s"] = steady_s
        old = _earlier_row(earlier, label, ov) if earlier is not None else None
        sat, cold = _row_runs(e, list(configs), seeds, jobs, progress, baseline, search, cache_dir)
        if old is not None:
            sat = {**{c: v for c, v in old["saturation"].items() if c not in sat}, **sat}
            cold = cold if cold is not None else old["realised_cold_fraction"]
        q = {c: sat[c]["qps_per_gpu"] for c in sat}

        def gain(a, b):
            return round(q[a] / q[b] - 1, 4) if (q.get(a) and q.get(b)) else None
        out.append({"label": label, "overrides": ov, "saturation": sat, "qps_per_gpu": q,
                    "ci": {c: sat[c]["ci"] for c in sat},
                    "at_least": {c: sat[c]["bounded"] == "at-least" for c in sat},
                    "gain_cpd_vs_baseline": gain(cpd, baseline), "gain_cpd_vs_pooled": gain(cpd, pooled),
                    "gains_vs_baseline": {c: gain(c, baseline) for c in sat if c != baseline},
                    "adaptive_over_best_other": _over_best_other(q),
                    "realised_cold_fraction": cold})
    names = list(configs) if earlier is None else [c for c in DEFAULT_CONFIGS if c in out[0]["saturation"]]
    return {"experiment": exp.get("name", ""), "configs": names, "baseline": baseline, "cpd": cpd,
            "pooled": pooled, "steady_s": steady_s or exp.get("steady_s"), "qps_per_gpu": exp["qps_per_gpu"],
            "seeds": seeds or exp.get("seeds", 3), "search": search, "rows": out}


def _row_runs(e: dict, configs: list[str], seeds, jobs: int, progress: bool, baseline: str, search: bool,
              cache_dir: Path | None) -> tuple[dict, float | None]:
    """One row's saturations and the realised cold share of the baseline's points (None without
    them), from ``cache_dir/rows/`` when this row ran before with the same inputs."""
    f = None
    if cache_dir is not None:
        key = hashlib.sha256(json.dumps([e, configs, seeds, baseline, search], sort_keys=True).encode()).hexdigest()[:16]
        f = cache_dir / "rows" / f"{key}.json"
        if f.exists():
            got = json.loads(f.read_text())
            return got["saturation"], got["realised_cold_fraction"]
    sat, pts = (_searched if search else _swept)(e, configs, seeds, jobs, progress, baseline)
    cold = round(sum(p["cold_fraction"] for p in pts) / len(pts), 3) if pts else None
    if f is not None:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"saturation": sat, "realised_cold_fraction": cold}, sort_keys=True, indent=1) + "\n")
    return sat, cold


def _swept(e: dict, configs: list[str], seeds, jobs: int, progress: bool, baseline: str):
    """Saturations (``qps_per_gpu``, ``ci``, ``bounded`` per configuration) and the baseline's points
    by :func:`cpd.sim.sweep.run_sweep`."""
    res = run_sweep(e, configs, seeds=seeds, progress=progress, jobs=jobs)
    return res["saturation"], [p for p in res["points"] if p["config"] == baseline]


def _over_best_other(q: dict[str, float | None]) -> float | None:
    """Adaptive ``cpd``'s saturation over the best of the others' (relative gain), None without them."""
    others = [v for c, v in q.items() if c != "cpd" and v]
    adaptive = q.get("cpd")
    return round(adaptive / max(others) - 1, 4) if adaptive and others else None


def _searched(e: dict, configs: list[str], seeds, jobs: int, progress: bool, baseline: str):
    """The same by :func:`cpd.sim.sweep.compare` (per-seed saturation searches)."""
    res = compare(e, configs, seeds, jobs)
    sat = {c: {"qps_per_gpu": d["saturation_qps_per_gpu"], "ci": d["ci"], "per_seed": d["per_seed"],
               "bounded": "at-least" if d["at_least"] else ("below" if d["below_lowest"] else "interpolated"),
               "busy_fraction_at_saturation": d["busy_fraction_at_saturation"]}
           for c, d in res["configs"].items()}
    if progress:
        print(" ".join(f"{c} {sat[c]['qps_per_gpu']}" for c in configs), flush=True)
    return sat, res["configs"].get(baseline, {}).get("points", [])


def markdown_table(s: dict) -> str:
    cfgs, b = s["configs"], s["baseline"]

    def f(r, k):
        v = r["qps_per_gpu"].get(k)
        if v is None:
            return f"< {min(s['qps_per_gpu'])}"
        ci = r.get("ci", {}).get(k)
        tail = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci and ci[0] is not None else ""
        return (">= " if r["at_least"].get(k) else "") + f"{v:.2f}" + tail

    def g(v):
        return "n/a" if v is None else f"{v * 100:+.0f} %"
    others = [c for c in cfgs if c != b]
    extra = [(f"{s['cpd']} vs {s['pooled']}", "gain_cpd_vs_pooled")] if {s["cpd"], s["pooled"]} <= set(cfgs) else []
    extra += [("cpd vs best other", "adaptive_over_best_other")] if "cpd" in cfgs and len(cfgs) > 1 else []
    lines = ["| assumption (one change from the reference) | realised cold | " + " | ".join(cfgs) + " | "
             + " | ".join([f"{c} vs {b}" for c in others] + [h for h, _ in extra]) + " |",
             "|---|---:|" + "---:|" * (len(cfgs) + len(others) + len(extra))]
    for r in s["rows"]:
        gv = r.get("gains_vs_baseline", {})
        cold = "—" if r["realised_cold_fraction"] is None else f"{r['realised_cold_fraction']:.2f}"
        lines.append(f"| {r['label']} | {cold} | " + " | ".join(f(r, c) for c in cfgs)
                     + " | " + " | ".join([g(gv.get(c)) for c in others] + [g(r.get(k)) for _, k in extra]) + " |")
    return "\n".join(lines) + "\n"


def render(s: dict, args: str, experiment: str = "reference_b200") -> str:
    """``sensitivity.md``: the table with how to regenerate and read it."""
    return (f"# Sensitivity of the CPD gain ({s['experiment']}, steady window {s['steady_s']:.0f} s per point)\n\n"
            f"Regenerate: `.venv/bin/python -m cpd.sim.sensitivity {experiment} {args}` (deterministic).\n\n"
            "Saturation QPS/GPU by the report's rule (goodput under the TTFT and TPOT SLOs >= the stated "
            "fraction, interpolated per seed; mean [95 % CI] over seeds), one assumption changed per row from "
            "the experiment file. `< x`: misses the SLO at the lowest load; `>= x`: meets it at the highest. "
            "*Realised cold* is the router-classified "
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
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--search", action="store_true", help="saturation by per-seed search (the adaptive grid's "
                                                          "rule) instead of the experiment's load grid")
    ap.add_argument("--quick", action="store_true", help="short points (cpd.sim.experiment.QUICK_WINDOWS); "
                                                         "implies --search")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma-separated configurations (default all four; the gains need pd, cpd-static, pd-l3)")
    ap.add_argument("--earlier", default=None, help="an earlier sensitivity.json (same experiment, rows and "
                                                    "flags): its other configurations join each row")
    a = ap.parse_args(argv)
    exp = load_experiment(a.experiment)
    if a.quick:
        exp = with_overrides(exp, QUICK_WINDOWS)
    earlier = json.loads(Path(a.earlier).read_text()) if a.earlier else None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s = run_sensitivity(exp, configs=tuple(a.configs.split(",")), steady_s=a.steady_s, jobs=a.jobs,
                        progress=not a.no_progress, seeds=a.seeds, search=a.search or a.quick, earlier=earlier,
                        cache_dir=out)
    (out / "sensitivity.json").write_text(json.dumps(s, sort_keys=True, indent=1) + "\n")
    flags = (" --quick" if a.quick else " --search" if a.search else "") + (f" --steady-s {a.steady_s:g}" if a.steady_s else "")
    md = render(s, f"--out {a.out}{flags}", a.experiment)
    (out / "sensitivity.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
