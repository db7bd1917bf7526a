"""Sweeps over configurations and loads, and the cold-fraction x output-length study.

Results are plain JSON-ready dicts with no wall-clock values, so two runs with the same
inputs give byte-identical files (``json.dumps(..., sort_keys=True)``).
"""
from __future__ import annotations

import copy
from typing import Any, Callable

from cpd.sim.experiment import build_cluster, run_point, saturation


def _bar(total: float, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="sim-s", leave=False, dynamic_ncols=True)


def _point(args):
    exp, cfg, q, overrides = args
    return run_point(exp, cfg, q, overrides=overrides)


def run_sweep(exp: dict, configs: list[str] | None = None, qps: list[float] | None = None,
              progress: bool = True, overrides: dict | None = None, jobs: int = 1) -> dict[str, Any]:
    """Every (configuration, QPS/GPU) point of ``exp``, then saturation and gain.

    ``jobs > 1`` runs points in that many worker *processes* (each point is an independent,
    single-threaded, deterministic simulation; results are collected in sweep order, so
    the output does not depend on ``jobs``).

    Returns:
        ``{"name", "points": [...], "saturation": {config: {...}}, "gain_vs": {...}, "slo": {...}}``.
        ``gain_vs[base][cfg]`` = saturation QPS/GPU of ``cfg`` / that of ``base`` - 1.
    """
    configs = configs or list(exp["configs"])
    qps = qps or exp["qps_per_gpu"]
    horizon = exp.get("ramp_s", 30) + exp.get("steady_s", 600) + exp.get("drain_s", 60)
    bar = _bar(len(configs) * len(qps) * horizon, exp.get("name", "sweep"), progress)
    points = []
    if jobs > 1:
        import multiprocessing as mp
        work = [(exp, c, q, overrides) for c in configs for q in qps]
        with mp.get_context("fork").Pool(jobs) as pool:
            for p in pool.imap(_point, work):
                points.append(p)
                if bar is not None:
                    bar.update(horizon)
                    bar.set_postfix_str(f"{p['config']} {p['qps_per_gpu']:.1f}")
    for cfg in (configs if jobs <= 1 else []):
        for q in qps:
            done = [0.0]

            def prog(t: float, done=done) -> None:
                if bar is not None:
                    bar.update(t - done[0])
                    done[0] = t
            p = run_point(exp, cfg, q, overrides=overrides, on_progress=prog)
            if bar is not None:
                bar.update(horizon - done[0])
                bar.set_postfix_str(f"{cfg} {q:.1f}")
            points.append(p)
    if bar is not None:
        bar.close()
    slo = exp.get("slo", {})
    p90, mc = slo.get("ttft_p90_s", 2.0), slo.get("min_completion_ratio", 0.98)
    sat = {c: saturation([p for p in points if p["config"] == c], p90, mc) for c in configs}
    gain: dict[str, dict[str, float | None]] = {}
    for base in configs:
        b = sat[base]["qps_per_gpu"]
        gain[base] = {c: (round(sat[c]["qps_per_gpu"] / b - 1, 4) if (b and sat[c]["qps_per_gpu"]) else None)
                      for c in configs if c != base}
    return {"name": exp.get("name", ""), "points": points, "saturation": sat, "gain_vs": gain,
            "slo": {"ttft_p90_s": p90, "min_completion_ratio": mc},
            "num_gpus": {c: build_cluster(exp, c).num_gpus for c in configs}}


def run_study(exp: dict, progress: bool = True, on_cell: Callable[[dict], None] | None = None,
              jobs: int = 1) -> dict[str, Any]:
    """Cold-fraction x output-length study: saturation of a baseline and CPD per cell.

    Uses ``exp["study"]``: ``{"baseline", "cpd", "cold_fraction": [...], "output_tokens": [...],
    "steady_s"}`` (a shorter steady window keeps it quick).
    """
    st = exp["study"]
    e = copy.deepcopy(exp)
    e["steady_s"] = st.get("steady_s", e.get("steady_s", 600))
    cells = []
    combos = [(c, o) for c in st["cold_fraction"] for o in st["output_tokens"]]
    it = combos
    if progress:
        from tqdm import tqdm
        it = tqdm(combos, desc="study", leave=False, dynamic_ncols=True)
    for c, o in it:
        r = run_sweep(e, [st["baseline"], st["cpd"]], progress=False,
                      overrides={"cold_fraction": c, "output_tokens": o}, jobs=jobs)
        b, p = r["saturation"][st["baseline"]], r["saturation"][st["cpd"]]
        cold = sum(x["cold_fraction"] for x in r["points"]) / len(r["points"])
        cell = {"cold_fraction_knob": c, "output_tokens": o, "realised_cold_fraction": round(cold, 4),
                "baseline": b, "cpd": p, "gain": r["gain_vs"][st["baseline"]][st["cpd"]]}
        cells.append(cell)
        if on_cell:
            on_cell(cell)
    return {"baseline": st["baseline"], "cpd": st["cpd"], "cells": cells, "steady_s": e["steady_s"]}
