"""Sweeps, saturation search and configuration comparison over seeds (engine-object simulator).

Saturation (one configuration, one seed): the highest offered QPS/GPU whose goodput (requests
meeting the TTFT SLO *and* the TPOT SLO, :mod:`cpd.sim.experiment`) stays >= ``slo.goodput_min``.
Found by a search, not read off a fixed grid: loads of the experiment's ``qps_per_gpu`` grid are
tried in increasing order until one fails (if none fails, the grid is extended by its last step
up to ``search.max_qps_per_gpu``), then the bracket [last passing, first failing] is bisected
``search.iters`` times; the saturation is the goodput crossing linearly interpolated inside the
final bracket. ``bounded`` says ``"interpolated"``, ``"below"`` (even the lowest load fails:
reported as 0) or ``"at-least"`` (nothing failed up to the cap: reported as the cap).

Across seeds: the mean and 95 % t-interval of the per-seed saturations (:mod:`cpd.sim.stats`).

Results are JSON-ready dicts without wall-clock values: the same inputs give byte-identical
files (``json.dumps(..., sort_keys=True)``); ``jobs`` only changes how fast they come.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from cpd.sim.experiment import build_cluster, config_names, num_gpus, run_point, slo_of
from cpd.sim.stats import mean_ci, rnd


def seeds_of(exp: dict, n: int | None = None) -> list[int]:
    """``n`` seeds (default ``exp["seeds"]``, else 3) starting at ``exp["seed"]``."""
    n = int(n if n is not None else exp.get("seeds", 3))
    if n < 1:
        raise ValueError("need at least one seed")
    s0 = int(exp.get("seed", 1))
    return list(range(s0, s0 + n))


def _passes(p: dict, gmin: float) -> bool:
    return p["goodput"] is not None and p["goodput"] >= gmin


def _crossing(lo: dict | None, hi: dict, gmin: float) -> float:
    """Goodput crossing between a passing point ``lo`` and a failing point ``hi`` (linear)."""
    if lo is None:
        return 0.0
    x0, y0, x1, y1 = lo["qps_per_gpu"], lo["goodput"], hi["qps_per_gpu"], hi["goodput"] or 0.0
    if y0 <= y1:
        return x0
    return x0 + (x1 - x0) * (y0 - gmin) / (y0 - y1)


def search_saturation(exp: dict, config: str, seed: int, overrides: dict | None = None) -> dict[str, Any]:
    """Saturation of one configuration for one seed by the search rule (module docstring).
    Returns ``{"qps_per_gpu", "bounded", "points": [...]}`` (every point it simulated)."""
    gmin = slo_of(exp)["goodput_min"]
    srch = exp.get("search", {})
    grid = sorted(float(q) for q in exp["qps_per_gpu"])
    cap = float(srch.get("max_qps_per_gpu", 2 * grid[-1]))
    step = grid[-1] - grid[-2] if len(grid) > 1 else grid[-1]
    pts: dict[float, dict] = {}

    def at(q: float) -> dict:
        q = round(q, 4)
        if q not in pts:
            pts[q] = run_point(exp, config, q, seed, overrides)
        return pts[q]
    lo: dict | None = None
    hi: dict | None = None
    loads = list(grid)
    while loads:
        q = loads.pop(0)
        p = at(q)
        if not _passes(p, gmin):
            hi = p
            break
        lo = p
        if not loads and q + step <= cap + 1e-9:
            loads.append(q + step)
    if hi is None:
        return {"qps_per_gpu": lo["qps_per_gpu"] if lo else None, "bounded": "at-least",
                "points": [pts[k] for k in sorted(pts)]}
    a = lo["qps_per_gpu"] if lo else 0.0
    for _ in range(int(srch.get("iters", 3))):
        mid = (a + hi["qps_per_gpu"]) / 2
        if mid - a < 1e-3:
            break
        p = at(mid)
        if _passes(p, gmin):
            lo, a = p, p["qps_per_gpu"]
        else:
            hi = p
    return {"qps_per_gpu": rnd(_crossing(lo, hi, gmin), 4), "bounded": "interpolated" if lo else "below",
            "last_ok": lo["qps_per_gpu"] if lo else None, "first_fail": hi["qps_per_gpu"],
            "points": [pts[k] for k in sorted(pts)]}


def _search_job(args):
    exp, cfg, seed, overrides = args
    return cfg, seed, search_saturation(exp, cfg, seed, overrides)


def saturation_summary(per_seed: Sequence[dict]) -> dict[str, Any]:
    """Mean and 95 % t-interval over seeds of per-seed saturations (a seed whose search found
    nothing failing counts with its lower bound and marks the summary ``at_least``)."""
    xs = [s["qps_per_gpu"] if s["qps_per_gpu"] is not None else 0.0 for s in per_seed]
    ci = mean_ci(xs)
    return {"saturation_qps_per_gpu": rnd(ci["mean"], 4), "ci": [rnd(ci["lo"], 4), rnd(ci["hi"], 4)],
            "n_seeds": ci["n"], "per_seed": [rnd(x, 4) for x in xs],
            "at_least": any(s["bounded"] == "at-least" for s in per_seed),
            "below_lowest": any(s["bounded"] == "below" for s in per_seed)}


def compare(exp: dict, configs: Sequence[str] | None = None, seeds: int | None = None, jobs: int = 1,
            overrides: dict | None = None, on_done: Callable[[str, int, dict], None] | None = None) -> dict[str, Any]:
    """Saturation search of every configuration for every seed.

    Returns ``{"name", "slo", "seeds", "configs": {NAME: {"saturation_qps_per_gpu", "ci", "n_seeds",
    "per_seed", "num_gpus", "points": [...]}}}``."""
    configs = list(configs or config_names(exp))
    ss = seeds_of(exp, seeds)
    work = [(exp, c, s, overrides) for c in configs for s in ss]
    res: dict[str, dict[int, dict]] = {c: {} for c in configs}
    for cfg, seed, r in _imap(_search_job, work, jobs):
        res[cfg][seed] = r
        if on_done is not None:
            on_done(cfg, seed, r)
    out: dict[str, Any] = {}
    for c in configs:
        per = [res[c][s] for s in ss]
        d = saturation_summary(per)
        d["num_gpus"] = num_gpus(build_cluster(exp, c))
        d["points"] = [p for s in ss for p in res[c][s]["points"]]
        d["busy_fraction_at_saturation"] = _busy_near(per)
        out[c] = d
    return {"name": exp.get("name", ""), "slo": slo_of(exp), "seeds": ss, "configs": out}


def _busy_near(per_seed: Sequence[dict]) -> dict[str, float | None]:
    """Busy fraction per pool at each seed's last passing load, averaged over seeds."""
    acc: dict[str, list[float]] = {}
    for s in per_seed:
        ok = [p for p in s["points"] if s.get("last_ok") is not None and p["qps_per_gpu"] == s["last_ok"]]
        for p in ok:
            for k, v in p["busy_fraction"].items():
                acc.setdefault(k, []).append(v)
    return {k: rnd(sum(v) / len(v), 4) for k, v in sorted(acc.items())}


def _imap(fn: Callable, work: list, jobs: int):
    """Results in work order (parallel when ``jobs > 1``)."""
    if jobs <= 1 or len(work) <= 1:
        for w in work:
            yield fn(w)
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    # not multiprocessing.Pool: a worker killed from outside (the kernel's OOM killer) lost its task
    # there and the sweep waited for it forever; here the run stops with an error naming the cause
    with ProcessPoolExecutor(min(jobs, len(work)), mp_context=mp.get_context("fork")) as pool:
        try:
            yield from pool.map(fn, work)
        except BrokenProcessPool as e:
            raise RuntimeError("a simulation process died (killed from outside, e.g. out of memory: "
                               "run with fewer --jobs)") from e


def _point_job(args):
    exp, cfg, q, seed, overrides = args
    return run_point(exp, cfg, q, seed, overrides)


def aggregate_points(points: Sequence[dict]) -> list[dict[str, Any]]:
    """One row per (configuration, load): goodput, TTFT p50/p90, TPOT p90 and busy fractions
    as mean with a 95 % t-interval over seeds."""
    by: dict[tuple[str, float], list[dict]] = {}
    for p in points:
        by.setdefault((p["config"], p["qps_per_gpu"]), []).append(p)
    rows = []
    for (c, q), ps in sorted(by.items()):
        def ci(get):
            m = mean_ci([get(p) for p in ps])
            return {"mean": rnd(m["mean"]), "lo": rnd(m["lo"]), "hi": rnd(m["hi"])}
        row = {"config": c, "qps_per_gpu": q, "n_seeds": len(ps), "goodput": ci(lambda p: p["goodput"]),
               "ttft_p50_s": ci(lambda p: p["ttft_s"]["p50"]), "ttft_p90_s": ci(lambda p: p["ttft_s"]["p90"]),
               "tpot_p90_s": ci(lambda p: p["tpot_s"]["p90"]), "cold_fraction": ci(lambda p: p["cold_fraction"]),
               "warmup_s": ci(lambda p: p["warmup_s"]),
               "busy_fraction": {k: ci(lambda p, k=k: p["busy_fraction"].get(k))
                                 for k in sorted({k for p in ps for k in p["busy_fraction"]})}}
        rows.append(row)
    return rows


def grid_saturation(points: Sequence[dict], gmin: float) -> dict[str, Any]:
    """Saturation of one configuration and seed read off a fixed grid of points (the goodput
    crossing between the last passing and the first failing load)."""
    pts = sorted(points, key=lambda p: p["qps_per_gpu"])
    prev = None
    for p in pts:
        if not _passes(p, gmin):
            return {"qps_per_gpu": rnd(_crossing(prev, p, gmin), 4), "bounded": "interpolated" if prev else "below",
                    "last_ok": prev["qps_per_gpu"] if prev else None, "first_fail": p["qps_per_gpu"]}
        prev = p
    return {"qps_per_gpu": pts[-1]["qps_per_gpu"] if pts else None, "bounded": "at-least",
            "last_ok": pts[-1]["qps_per_gpu"] if pts else None, "first_fail": None}


def run_sweep(exp: dict, configs: list[str] | None = None, qps: list[float] | None = None,
              seeds: int | None = None, progress: bool = False, overrides: dict | None = None,
              jobs: int = 1) -> dict[str, Any]:
    """Every (configuration, QPS/GPU, seed) point of a fixed grid, aggregated over seeds, with the
    grid saturation per seed and its mean / CI per configuration.

    Returns ``{"name", "slo", "seeds", "points": [per seed], "rows": [aggregated],
    "saturation": {cfg: {...saturation_summary, "qps_per_gpu", "bounded"}}, "gain_vs": {...},
    "num_gpus": {...}}``; ``gain_vs[base][cfg]`` = mean saturation of ``cfg`` / that of ``base`` - 1."""
    configs = configs or config_names(exp)
    qs = qps or exp["qps_per_gpu"]
    ss = seeds_of(exp, seeds)
    work = [(exp, c, q, s, overrides) for c in configs for q in qs for s in ss]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(work), desc=exp.get("name", "sweep"), unit="point", leave=False, dynamic_ncols=True)
    points = []
    for p in _imap(_point_job, work, jobs):
        points.append(p)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    gmin = slo_of(exp)["goodput_min"]
    sat = {}
    for c in configs:
        per = [grid_saturation([p for p in points if p["config"] == c and p["seed"] == s], gmin) for s in ss]
        d = saturation_summary(per)
        d.update(qps_per_gpu=d["saturation_qps_per_gpu"],
                 bounded="at-least" if d["at_least"] else ("below" if d["below_lowest"] else "interpolated"))
        sat[c] = d
    gain: dict[str, dict[str, float | None]] = {}
    for base in configs:
        b = sat[base]["qps_per_gpu"]
        gain[base] = {c: (round(sat[c]["qps_per_gpu"] / b - 1, 4) if (b and sat[c]["qps_per_gpu"]) else None)
                      for c in configs if c != base}
    return {"name": exp.get("name", ""), "slo": slo_of(exp), "seeds": ss, "points": points,
            "rows": aggregate_points(points), "saturation": sat, "gain_vs": gain,
            "num_gpus": {c: num_gpus(build_cluster(exp, c)) for c in configs}}
