"""The Recommendation section of ``cpd analyze``: pools from the policy's classes and the role
planner's rule (:mod:`cpd.analyze.recommend`), a saturation search of each configuration on the
trace with the simulator of ``cpd simulate --compare`` (:func:`cpd.sim.sweep.compare`), the
choice, and the ``cpd serve`` flags. Writes nothing itself: :func:`recommend` returns the
``recommendation.json`` dict and :func:`markdown` its report lines.

Simulation budget (:class:`SimBudget`): seeds, the steady window of each point (plus
``RAMP_S`` ramp and ``DRAIN_S`` drain), bisection steps and the starting loads. The default
starting loads are 0.5x and 1x the modeled capacity of the recommended pools (the load at which
the prefill side or the decode pool would be fully busy by the roofline); the search goes up to
twice the highest starting load.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cpd.analyze.recommend import (CONFIG_ORDER, ELASTIC, ClassWork, choose, classify, decode_nodes, own_work_s,
                                   planner_settles, seeds_vary, serve_flags, sim_configs, split_prefill_side,
                                   window_splits)
from cpd.policy.roles import PlannerConfig

RAMP_S = 5.0
DRAIN_S = 10.0
GOODPUT_MIN = 0.9
FEW_REQUESTS_PER_POINT = 100
"""Below this mean number of requests in a point's steady window the report warns that the
figures cannot tell configurations apart (goodput moves in steps of 1 / requests)."""


class TooFewGpus(ValueError):
    """``total_gpus`` cannot hold a decode node and two prefill-side workers."""


@dataclass(frozen=True)
class SimBudget:
    """What the recommendation may spend on simulation (module docstring)."""

    seeds: int = 1
    steady_s: float = 20.0
    iters: int = 2
    loads: tuple[float, ...] = ()   # starting QPS/GPU grid; empty: from the modeled capacity
    jobs: int = 1


@dataclass(frozen=True)
class TraceInput:
    """The trace as ``cpd analyze`` read it: per-request arrival (s), prompt, cached-prefix and
    output tokens (infinite cache), and how the simulator replays it (``workload`` of an experiment)."""

    arrival_s: Sequence[float]
    prompt_tokens: Sequence[int]
    cached_tokens: Sequence[int]
    output_tokens: Sequence[int]
    block_tokens: int
    workload: dict
    timed: bool = True   # arrivals are the trace's own (Mooncake, Azure); False: sessions placed by a model


def experiment(model: str, gpu: str, kv_dtype_bytes: float, tp: int, ttft_slo_s: float, tpot_slo_s: float,
               workload: dict, budget: SimBudget) -> dict:
    """The ``reference_b200`` experiment with this model, GPU, prefill TP, SLOs, trace and budget
    (layout, configurations and loads are set by :func:`recommend`)."""
    from cpd.sim.experiment import load_experiment
    exp = copy.deepcopy(load_experiment("reference_b200"))
    exp.update(model=model, gpu=gpu, kv_dtype_bytes=kv_dtype_bytes, ramp_s=RAMP_S, steady_s=budget.steady_s,
               drain_s=DRAIN_S, seeds=budget.seeds, workload=dict(workload),
               slo={"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s, "goodput_min": GOODPUT_MIN})
    exp["prefill"] = dict(exp["prefill"], tp=tp)
    exp["search"] = dict(exp.get("search", {}), iters=budget.iters)
    exp["name"] = f"cpd analyze on {workload.get('path', 'trace')}"
    return exp


def _classes(exp: dict, t: TraceInput) -> tuple[list[float], float, Any, Any, TraceInput]:
    """Each request's own work under the simulated router's own cost model and adaptive routing
    settings, the heavy threshold, the prefill and decode instances' roofline models, and the
    trace with its prompts truncated to the model's context as the replay does."""
    from cpd.policy.routing import heavy_uncached_s
    from cpd.sim.experiment import build_cluster, routing_config
    probe = dict(exp, layout={"prefill_nodes": 2, "decode_nodes": 1}, configs={})
    cl = build_cluster(probe, "cpd")
    rcfg = dataclasses.replace(routing_config(exp, {"topology": "cpd", "mode": "adaptive"}),
                               block_size=t.block_tokens)
    pcost = next(i.cost for i in cl.instances if i.role != "decode")
    dcost = next(i.cost for i in cl.instances if i.role == "decode")
    ctx = context_tokens(pcost)
    fit = [min(p, max(1, ctx - o)) for p, o in zip(t.prompt_tokens, t.output_tokens)]  # the replay's context_len
    ft = dataclasses.replace(t, prompt_tokens=fit, cached_tokens=[min(c, p) for p, c in zip(fit, t.cached_tokens)])
    own = [own_work_s(p, c, rcfg, cl.router_cost) for p, c in zip(ft.prompt_tokens, ft.cached_tokens)]
    return own, heavy_uncached_s(rcfg), pcost, dcost, ft


def context_tokens(pcost) -> int:
    """The modeled model's context (``max_position_embeddings``): the simulated engines refuse a
    longer prompt, so the replay truncates prompts to it minus their output (``context_len``)."""
    return int(pcost.model.max_context)


def role_window_s() -> float:
    """The live planner's measurement window (``router.role_window_s`` default)."""
    from cpd.config import RouterSection
    return float(RouterSection.model_fields["role_window_s"].default)


def _window_targets(t: TraceInput, own: Sequence[float], th: float, total_qps: float, side: int,
                    pcfg: PlannerConfig) -> list[int]:
    """The planner's target per role window with the trace time-scaled to ``total_qps`` as the
    simulator replays timed traces; none for session traces (their replay interleaves sessions by
    an arrival model at the simulated load, not by these arrivals)."""
    span = max(t.arrival_s) - min(t.arrival_s) if t.arrival_s else 0.0
    if not t.timed or span <= 0 or total_qps <= 0:
        return []
    k = len(t.arrival_s) / span / total_qps   # trace seconds -> seconds at total_qps
    return window_splits([a * k for a in t.arrival_s], own, th, role_window_s(), side, pcfg)


def _gpu_seconds(exp: dict, t: TraceInput, pcost, dcost) -> tuple[float, float]:
    """Modeled GPU-seconds per request: prefill side (uncached suffix on the cached prefix) and
    decode (output tokens at the decode pool's full batch, mean context)."""
    n = max(1, len(t.prompt_tokens))
    pf = sum(pcost.prefill_time_s(p - c, c) for p, c in zip(t.prompt_tokens, t.cached_tokens)) / n * pcost.tp
    out = sum(t.output_tokens) / n
    ctx = sum(t.prompt_tokens) / n + out / 2
    b = int(exp["decode"].get("max_num_seqs", 24))
    dec = out * dcost.decode_step_time_s(b, int(b * ctx)) / b * dcost.tp
    return pf, dec


@dataclass
class _Plan:
    """What the simulation step needs from the planning step of :func:`recommend`."""

    exp: dict
    names: list[str]
    loads: list[float]
    cw: ClassWork
    split: Any
    side: int
    used: int
    cap: float
    report: dict[str, Any]


def recommend(exp: dict, t: TraceInput, total_gpus: int, configs: Sequence[str], budget: SimBudget,
              simulate: bool = True, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Pools, simulated saturations, choice and ``cpd serve`` flags (``recommendation.json``).
    Raises :class:`TooFewGpus` when ``total_gpus`` is too few for a decode node and two
    prefill-side workers; ValueError for an unknown configuration name."""
    plan = _plan(exp, t, total_gpus, configs, budget)
    if simulate:
        _simulated_choice(plan, budget, progress)
    return plan.report


def _plan(exp: dict, t: TraceInput, total_gpus: int, configs: Sequence[str], budget: SimBudget) -> _Plan:
    """Classes, pools (rules 1-3 of :mod:`cpd.analyze.recommend`), the configurations worth
    simulating and the starting loads."""
    own, th, pcost, dcost, fitted = _classes(exp, t)
    cw = classify(own, th)
    ctx = context_tokens(pcost)
    exp = dict(exp, workload=dict(exp["workload"], context_len=exp["workload"].get("context_len") or ctx))
    pf_gpu_s, dec_gpu_s = _gpu_seconds(exp, fitted, pcost, dcost)
    ranks = int(exp["decode"].get("ranks_per_node", 4))
    dnode_gpus = ranks * dcost.tp
    try:
        d = decode_nodes(pf_gpu_s, dec_gpu_s, total_gpus, dnode_gpus, pcost.tp)
    except ValueError as e:
        raise TooFewGpus(str(e)) from None
    side = (total_gpus - d * dnode_gpus) // pcost.tp
    split = split_prefill_side(cw.cold_work_s, cw.warm_work_s, side, PlannerConfig())
    used = side * pcost.tp + d * dnode_gpus
    cap = min(side * pcost.tp / max(pf_gpu_s, 1e-12), d * dnode_gpus / max(dec_gpu_s, 1e-12)) / used
    targets = _window_targets(t, own, th, cap * used, side, PlannerConfig())
    skipped = _elastic_skipped(configs, side, targets)
    report: dict[str, Any] = {
        "slo": {"ttft_s": exp["slo"]["ttft_s"], "tpot_s": exp["slo"]["tpot_s"], "goodput_min": GOODPUT_MIN},
        "model": exp["model"], "gpu": exp["gpu"], "total_gpus": total_gpus, "gpus_used": used,
        "context_tokens": ctx,
        "truncated_requests": sum(1 for p, o in zip(t.prompt_tokens, t.output_tokens) if p + o > ctx),
        "classes": {"heavy_uncached_s": cw.heavy_uncached_s, "requests": cw.num_requests, "heavy": cw.num_heavy,
                    "cold_work_s_per_request": cw.cold_work_s / max(1, cw.num_requests),
                    "warm_work_s_per_request": cw.warm_work_s / max(1, cw.num_requests), "cold_share": cw.cold_share},
        "busy_model": {"prefill_gpu_s_per_request": pf_gpu_s, "decode_gpu_s_per_request": dec_gpu_s,
                       "capacity_qps_per_gpu": cap},
        "nodes": {"prefill_side_workers": side, "prefill_worker_gpus": pcost.tp, "decode_nodes": d,
                  "decode_node_gpus": dnode_gpus},
        "pools": {"pre-prefill": split.pre_prefill, "prefill": split.prefill, "decode": d * ranks},
        "split": {"rule": "planner target: min over splits of max(cold/n_pre, warm/n_prefill) within the minimums",
                  "load_per_worker_at_capacity": _loads_at(cw, split, cap * used),
                  "window_s": role_window_s(), "window_targets": _histogram(targets)},
        "skipped": skipped, "choice": None, "configs": {}, "serve_flags": None,
    }
    loads = sorted(budget.loads) or [round(0.5 * cap, 3), round(cap, 3)]
    exp = dict(exp, qps_per_gpu=loads, layout={"prefill_nodes": side, "decode_nodes": d},
               configs=sim_configs([c for c in configs if c not in skipped], split.pre_prefill, split.prefill, d))
    exp["search"] = dict(exp["search"], max_qps_per_gpu=2 * loads[-1])
    return _Plan(exp, [c for c in configs if c not in skipped], loads, cw, split, side, used, cap, report)


def _elastic_skipped(configs: Sequence[str], side: int, targets: Sequence[int]) -> dict[str, str]:
    """``cpd-elastic`` is not simulated where the planner provably moves nobody: too few workers
    to move any past the pool minimums, or the same target split in every role window."""
    pcfg = PlannerConfig()
    if ELASTIC in configs and side <= pcfg.min_pre_prefill + pcfg.min_prefill:
        return {ELASTIC: f"{side} prefill-side workers are the planner's two pool minimums: it can move none "
                         "(elastic = cpd)"}
    if ELASTIC in configs and len(set(targets)) == 1:
        return {ELASTIC: "the planner's target is the recommended split in every role window, so the planner "
                         "started there moves nobody (elastic = cpd)"}
    return {}


def _simulated_choice(plan: _Plan, budget: SimBudget, progress) -> None:
    """Saturation search of the plan's configurations, the choice and its flags, into ``plan.report``."""
    out, exp = plan.report, plan.exp
    res, cost = _simulate(exp, plan.names, budget, progress)
    out["budget"] = cost
    if cost["requests"] == 0:
        out["no_choice"] = ("the simulated steady windows held no requests: the replay of this trace offers too "
                            "few requests at these loads (a session trace replays only the sessions it has); "
                            "try a longer --sim-steady-s or a trace with more sessions")
        return
    if cost["requests"] < FEW_REQUESTS_PER_POINT * cost["points"]:
        out["warning"] = (f"the steady windows held {cost['requests'] / cost['points']:.0f} requests per point on "
                          f"average (< {FEW_REQUESTS_PER_POINT}): too few to tell configurations apart; raise "
                          "--sim-steady-s (session traces need windows longer than their think times)")
    ch = choose(res["configs"])
    sat_qps = (res["configs"][ch.config]["saturation_qps_per_gpu"] or plan.cap) * plan.used
    c_rate, w_rate = plan.cw.rates(sat_qps)
    pcfg = PlannerConfig()
    out.update(
        configs={c: {**{k: v for k, v in r.items() if k != "points"},
                     "first_fail": _first_fail(r["points"], exp["slo"])} for c, r in res["configs"].items()},
        choice=dataclasses.asdict(ch),
        serve_flags=serve_flags(ch.config, out["pools"], exp["slo"]["ttft_s"], exp["slo"]["tpot_s"]))
    out["split"].update(
        load_per_worker_at_choice=_loads_at(plan.cw, plan.split, sat_qps),
        planner_from_split=planner_settles(c_rate, w_rate, plan.side, plan.split.pre_prefill, pcfg).pre_prefill,
        planner_from_one=planner_settles(c_rate, w_rate, plan.side, pcfg.min_pre_prefill, pcfg).pre_prefill)


def _histogram(targets: Sequence[int]) -> dict[str, int]:
    """Role windows per pre-prefill target (JSON keys are strings)."""
    out: dict[str, int] = {}
    for k in targets:
        out[str(k)] = out.get(str(k), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _first_fail(points: Sequence[dict], slo: dict) -> dict[str, Any] | None:
    """The lowest simulated load that missed the goodput target, its TTFT / TPOT p90 and which of
    them is over its SLO (``limit``: ``ttft``, ``tpot``, ``both`` or ``neither``: fewer than 10 %
    of requests missed each alone, more missed one or the other)."""
    bad = sorted((p for p in points if (p["goodput"] or 0.0) < GOODPUT_MIN), key=lambda p: p["qps_per_gpu"])
    if not bad:
        return None
    p = bad[0]
    tt, tp = p["ttft_s"]["p90"], p["tpot_s"]["p90"]
    over = [k for k, x, lim in (("ttft", tt, slo["ttft_s"]), ("tpot", tp, slo["tpot_s"])) if x is None or x > lim]
    limit = "both" if len(over) == 2 else (over[0] if over else "neither")
    return {"qps_per_gpu": p["qps_per_gpu"], "goodput": p["goodput"], "ttft_p90_s": tt, "tpot_p90_s": tp,
            "limit": limit}


def _loads_at(cw: ClassWork, split, total_qps: float) -> dict[str, float]:
    c, w = cw.rates(total_qps)
    return {"pre-prefill": c / max(1, split.pre_prefill), "prefill": w / max(1, split.prefill),
            "total_qps": total_qps}


def _simulate(exp: dict, names: Sequence[str], budget: SimBudget, progress) -> tuple[dict, dict]:
    """:func:`cpd.sim.sweep.compare` with its cost (points, simulated and wall seconds)."""
    from cpd.sim.sweep import compare

    def done(cfg: str, seed: int, r: dict) -> None:
        if progress is not None:
            progress(f"  {cfg} seed {seed}: {r['qps_per_gpu']} QPS/GPU ({r['bounded']}, {len(r['points'])} points)")
    t0 = time.perf_counter()
    res = compare(exp, list(names), budget.seeds, budget.jobs, on_done=done)
    wall = time.perf_counter() - t0
    pts = [p for r in res["configs"].values() for p in r["points"]]
    cost = {"seeds": budget.seeds, "ramp_s": RAMP_S, "steady_s": budget.steady_s, "drain_s": DRAIN_S,
            "iters": budget.iters, "loads": exp["qps_per_gpu"], "max_qps_per_gpu": exp["search"]["max_qps_per_gpu"],
            "points": len(pts), "simulated_s": round(sum(p["simulated_s"] for p in pts), 1),
            "requests": sum(p["requests"] for p in pts), "wall_s": round(wall, 1), "jobs": budget.jobs}
    return res, cost


def _sat(d: dict) -> str:
    x = d["saturation_qps_per_gpu"]
    if x is None:
        return "—"
    if d.get("below_lowest"):
        return "< lowest load"
    return (">= " if d.get("at_least") else "") + f"{x:.3f}"


def _cost(b: dict[str, Any]) -> str:
    """What the simulation cost, and its budget."""
    return (f"Cost: {b['points']} points, {b['requests']} requests, {b['simulated_s']:.0f} simulated s in "
            f"{b['wall_s']:.0f} s wall ({b['seeds']} seed(s), {b['ramp_s']:g} + {b['steady_s']:g} + "
            f"{b['drain_s']:g} s per point, start loads {b['loads']}, {b['iters']} bisection steps, cap "
            f"{b['max_qps_per_gpu']:.2f}).")


def _fail(f: dict[str, Any] | None) -> str:
    if f is None:
        return "none failed"

    def s(x: float | None) -> str:
        return "—" if x is None else f"{x:.3f} s"
    return f"{f['qps_per_gpu']:g}: {f['goodput']:.2f}, {s(f['ttft_p90_s'])}, {s(f['tpot_p90_s'])}"


def markdown(rec: dict[str, Any]) -> list[str]:
    """The report's Recommendation section."""
    slo, nd, pools, cl = rec["slo"], rec["nodes"], rec["pools"], rec["classes"]
    L = ["", "## Recommendation", ""]
    L.append(f"Pools for {rec['gpus_used']} of {rec['total_gpus']} GPUs: {nd['prefill_side_workers']} prefill-side "
             f"workers of {nd['prefill_worker_gpus']} GPUs (engine TP) + {nd['decode_nodes']} decode node(s) of "
             f"{nd['decode_node_gpus']} GPUs ({pools['decode']} decode workers).")
    n = max(1, cl["requests"])
    if rec["truncated_requests"]:
        L.append(f"* {rec['truncated_requests']} request(s) ({rec['truncated_requests'] / n * 100:.1f} %) do not fit "
                 f"the model's {rec['context_tokens']}-token context with their output: their prompts are truncated "
                 "to it here and in the simulation (`context_len`)")
    L.append(f"* classes as the adaptive router makes them: heavy (`cold`) = own work (uncached compute on the "
             f"prefix holder, router cost model) > {cl['heavy_uncached_s']:g} s (`router.heavy_uncached_s`, "
             "default a quarter of the TTFT SLO): "
             f"{cl['heavy'] / n * 100:.1f} % of requests, {cl['cold_share'] * 100:.1f} % of prefill work "
             f"({cl['cold_work_s_per_request']:.3f} s cold + {cl['warm_work_s_per_request']:.3f} s warm per request)")
    sp = rec["split"]
    lp = sp.get("load_per_worker_at_choice") or sp["load_per_worker_at_capacity"]
    L.append(f"* pre-prefill {pools['pre-prefill']}, prefill {pools['prefill']}: the role planner's target "
             f"(cpd.policy.roles: the split with the smallest larger per-worker load; independent of the load); "
             f"at {lp['total_qps']:.1f} QPS the router estimates {lp['pre-prefill']:.2f} s/s of cold work per "
             f"pre-prefill worker and {lp['prefill']:.2f} s/s of warm work per prefill worker")
    bm = rec["busy_model"]
    L.append(f"* decode: {nd['decode_nodes']} node(s) by modeled busy time ({bm['prefill_gpu_s_per_request']:.3f} "
             f"prefill-side vs {bm['decode_gpu_s_per_request']:.3f} decode GPU-s per request); modeled capacity "
             f"{bm['capacity_qps_per_gpu']:.2f} QPS/GPU")
    wt = sp["window_targets"]
    if wt:
        L.append(f"* the same rule per {sp['window_s']:g} s role window of the trace (time-scaled to "
                 f"{sp['load_per_worker_at_capacity']['total_qps']:.1f} QPS): pre-prefill target "
                 + ", ".join(f"{k} in {v} window(s)" for k, v in wt.items())
                 + (" — elastic roles would move workers as the mix changes" if len(wt) > 1 else
                    " — the mix never calls for another split"))
    pcfg = PlannerConfig()
    if "planner_from_one" in sp and nd["prefill_side_workers"] > pcfg.min_pre_prefill + pcfg.min_prefill:
        one, here = sp["planner_from_one"], sp["planner_from_split"]
        tail = ("reaches the same split" if one == pools["pre-prefill"] else
                f"stops at {one} (a move must lower the larger per-worker load by more than the planner's "
                "hysteresis), so give the pools explicitly")
        L.append(f"* `--elastic` at the chosen load: started at this split the planner keeps {here} pre-prefill; "
                 f"started at 1 it {tail}")
    if rec["choice"] is None:
        why = rec.get("no_choice") or "no simulation was run (--no-simulate)"
        L.append(f"* **no configuration chosen**: {why}; the pools above are for a cpd deployment")
        return L + ([f"* {_cost(rec['budget'])}"] if rec.get("budget") else [])
    L += ["", f"Saturation QPS/GPU on this trace (goodput >= {slo['goodput_min']} under TTFT <= {slo['ttft_s']:g} s "
          f"and TPOT <= {slo['tpot_s']:g} s; engine-object simulator and search of `cpd simulate --compare`, same "
          f"GPUs for every configuration). {_cost(rec['budget'])}", "",
          "| configuration | saturation QPS/GPU | 95 % CI | seeds | busy at saturation | first failing load: "
          "goodput, TTFT p90, TPOT p90 |", "|---|---:|---|---:|---|---|"]
    for c, d in rec["configs"].items():
        lo, hi = d["ci"]
        ci = ("— (one seed)" if d["n_seeds"] < 2 or lo is None else
              f"[{lo:.3f}, {hi:.3f}]" + ("" if seeds_vary(d) else " (seeds identical)"))
        busy = ", ".join(f"{k} {v:.2f}" for k, v in d.get("busy_fraction_at_saturation", {}).items()) or "—"
        L.append(f"| {c} | {_sat(d)} | {ci} | {d['n_seeds']} | {busy} | {_fail(d.get('first_fail'))} |")
    if rec.get("warning"):
        L += ["", f"**Warning**: {rec['warning']}."]
    ch = rec["choice"]
    verb = "**Run `" + ch["config"] + "`**" if ch["separated"] else f"**Best by the mean: `{ch['config']}`**"
    L += ["", f"* {verb}: {ch['why']}."]
    lim = (rec["configs"][ch["config"]].get("first_fail") or {}).get("limit")
    if lim in ("tpot", "ttft"):
        side = ("the decode pool (TPOT p90 over its SLO, TTFT within): it was sized by modeled busy time, so a "
                "decode node more is the next split to try" if lim == "tpot" else
                "the prefill side (TTFT p90 over its SLO, TPOT within)")
        L.append(f"* `{ch['config']}` is limited by {side}")
    if not ch["separated"] and len(ch["within_interval"]) > 1:
        L.append(f"* within its interval: {', '.join(ch['within_interval'])} (the simplest is "
                 f"`{ch['within_interval'][0]}`)")
    for c, why in rec["skipped"].items():
        L.append(f"* {c} not simulated: {why}")
    L.append("* `cpd serve " + " ".join(rec["serve_flags"]) + "`")
    L.append("* flag map: configuration → `--topology` (pd / cpd) and `--routing-mode` (static / adaptive); "
             "L3 write-through → `--write-through` (cpd default cold, pd-l3 = `--write-through all`); SLOs of the "
             "adaptive rules → `--ttft-slo` / `--tpot-slo`; pools → `--pre-prefill` / `--prefill` / `--decode` "
             "(workers); elastic roles → `--elastic`. Engine TP per worker (`--tp`, key engine.tp) is one value for "
             f"every worker: the simulation used TP {nd['prefill_worker_gpus']} prefill-side and data-parallel "
             "decode workers.")
    return L


def default_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


__all__ = ["CONFIG_ORDER", "SimBudget", "TooFewGpus", "TraceInput", "default_progress", "experiment", "markdown",
           "recommend"]
