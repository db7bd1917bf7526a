"""Experiments on the engine-object simulator (:mod:`cpd.sim.engine_sim`): clusters from an
experiment file, one point per (configuration, load, seed), steady-window metrics, goodput.

Experiment file (JSON), see ``cpd/sim/experiments/reference_b200.json``::

    {"name", "model", "gpu", "kv_dtype_bytes", "weight_bytes_per_param", "efficiency": {...},
     "block_size", "kv_event_delay_s", "l3_bytes", "cold_threshold", "router_cost": "learned[-fit]" | "linear" | "linear-flat" | "roofline",
     "l3_events": "step-end" (default) | "next-flush" (EngineClusterSpec.l3_events_next_flush), "idle_flush_s",
     "queue_remaining": false (default) | true (EngineClusterSpec.queue_remaining),
     "prefill": {"tp", "max_num_batched_tokens", "max_prefill_chunk_tokens", "max_num_seqs", "l2_bytes"},
     "decode":  {"tp", "ranks_per_node", "max_num_seqs"},
     "layout": {"prefill_nodes": 2, "decode_nodes": 1},      # GPUs of the named configurations
     "configs": {NAME: {"topology", "pre_prefill", "prefill", "decode", "l3_bytes",
                        "mode": "static" | "adaptive", "write_through": "none" | "cold" | "all",
                        "elastic": {PlannerConfig fields} }, ...},
     "routing": {RoutingConfig fields (adaptive knobs), optional},
     "workload": {"kind": "agent", ...AgentWorkload fields} | {"kind": "trace", "path", ...},
     "qps_per_gpu": [...], "ramp_s", "steady_s", "drain_s", "seed", "seeds",
     "slo": {"ttft_s", "tpot_s", "goodput_min"}, "search": {"iters", "max_qps_per_gpu"}}

Configurations by name (the same names as the live system's, :data:`NAMED_CONFIGS`), all on the
GPUs of ``layout`` (``prefill_nodes`` prefill-side nodes, ``decode_nodes`` decode nodes):
``pd`` (plain P/D, local prefix caches, no L3), ``pd-l3`` (P/D whose prefill workers write every
computed block through to the shared L3 and read from it), ``cpd-static`` (one prefill node turned
pre-prefill; reuse-ratio classes; cold work writes through), ``cpd`` (the same GPUs, adaptive
routing). An experiment file's own ``configs`` may add or override names.

Normalisation: ``QPS/GPU = offered total QPS / all GPUs of the configuration``.

Per point (:func:`run_point`): arrivals over ``ramp_s + steady_s`` (linear ramp), the run goes on
``drain_s`` after. The **steady window** is ``[t_warm, ramp_s + steady_s)`` where ``t_warm`` is the
later of ``ramp_s`` and the MSER-5 truncation point of the TTFT series (requests in arrival
order, unfinished ones counted with their time so far; :mod:`cpd.sim.stats`). **Goodput** = the
fraction of the window's requests that got their first token within ``slo.ttft_s`` *and* (more
than one output token) finished with TPOT = (last token - first token) / (output - 1) within
``slo.tpot_s``; a rejected or unfinished request fails, and in closed-loop workloads the
fraction is taken over the larger of the requests that arrived and those scheduled to arrive in
the window (an overloaded cluster receives fewer turns). Busy time per pool = engine step and
transfer time per instance of that role over ``[ramp_s, ramp_s + steady_s)``, divided by the
window and the pool's instance count (roles as at the end of the run).
"""
from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from cpd.engine.scheduler import SchedulerConfig
from cpd.policy.cost_model import Efficiency, RooflineCostModel
from cpd.costmodel.prior import linear_router_cost
from cpd.policy.routing import RoutingConfig
from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator
from cpd.sim.stats import mser5, pct, rnd
from cpd.sim.workload import AgentWorkload, SimRequest, agent_workload
from cpd.types import Role, RoutingMode, Topology, WriteThrough

EXPERIMENTS_DIR = Path(__file__).parent / "experiments"

NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "pd": {"topology": "pd", "write_through": "none", "l3_bytes": 0},
    "pd-l3": {"topology": "pd", "write_through": "all"},
    "cpd-static": {"topology": "cpd", "mode": "static"},
    "cpd": {"topology": "cpd", "mode": "adaptive"},
}
"""The configurations every experiment knows by name (module docstring); node counts come from
the experiment's ``layout``."""

DEFAULT_SLO = {"ttft_s": 1.0, "tpot_s": 0.05, "goodput_min": 0.9}


def load_experiment(path: str | Path) -> dict:
    """Read an experiment JSON (a path or a shipped name such as ``reference_b200``)."""
    p = Path(path)
    if not p.is_file():
        p = EXPERIMENTS_DIR / f"{path}.json"
    if not p.is_file():
        raise FileNotFoundError(f"no experiment {path!r} (neither a file nor in {EXPERIMENTS_DIR})")
    return json.loads(p.read_text())


def slo_of(exp: dict) -> dict[str, float]:
    """The experiment's SLOs with defaults (:data:`DEFAULT_SLO`)."""
    s = dict(DEFAULT_SLO)
    s.update({k: v for k, v in exp.get("slo", {}).items() if k in DEFAULT_SLO})
    return s


def config_spec(exp: dict, name: str) -> dict[str, Any]:
    """The configuration dict of ``name``: a named one (:data:`NAMED_CONFIGS`) on the experiment's
    ``layout``, updated by the experiment's own entry of that name if any."""
    lay = exp.get("layout", {"prefill_nodes": 2, "decode_nodes": 1})
    out: dict[str, Any] = {}
    if name in NAMED_CONFIGS:
        out = dict(NAMED_CONFIGS[name])
        n = int(lay.get("prefill_nodes", 2))
        cpd = out["topology"] == "cpd"
        out.update(pre_prefill=1 if cpd else 0, prefill=n - 1 if cpd else n, decode=int(lay.get("decode_nodes", 1)))
    out.update(exp.get("configs", {}).get(name, {}))
    if not out:
        known = sorted(set(NAMED_CONFIGS) | set(exp.get("configs", {})))
        raise KeyError(f"unknown configuration {name!r} (known: {', '.join(known)})")
    return out


def config_names(exp: dict) -> list[str]:
    """The experiment's configurations: its own ``configs`` (in file order), else the named ones."""
    return list(exp.get("configs") or NAMED_CONFIGS)


def _costs(exp: dict) -> tuple[RooflineCostModel, RooflineCostModel]:
    eff = Efficiency(**exp.get("efficiency", {}))
    common = dict(kv_dtype_bytes=exp.get("kv_dtype_bytes", 2), weight_bytes_per_param=exp.get("weight_bytes_per_param", 2),
                  fp8_compute=exp.get("fp8_compute", False), eff=eff)
    pf, dc = exp["prefill"], exp["decode"]
    return (RooflineCostModel.build(exp["model"], exp["gpu"], tp=pf.get("tp", 4), **common),
            RooflineCostModel.build(exp["model"], exp["gpu"], tp=dc.get("tp", 1), **common))


def routing_config(exp: dict, cfg: dict) -> RoutingConfig:
    """The live :class:`RoutingConfig` of one configuration (topology, mode, write-through, SLOs)."""
    slo = slo_of(exp)
    extra = {k: v for k, v in exp.get("routing", {}).items() if k in {f.name for f in fields(RoutingConfig)}}
    wt = cfg.get("write_through")
    return RoutingConfig(topology=Topology(cfg.get("topology", "cpd")), cold_threshold=exp.get("cold_threshold", 0.5),
                         block_size=exp.get("block_size", 512), mode=RoutingMode(cfg.get("mode", "static")),
                         write_through=WriteThrough(wt) if wt is not None else None,
                         ttft_slo_s=slo["ttft_s"], tpot_slo_s=slo["tpot_s"], **extra)


def build_cluster(exp: dict, config: str) -> EngineClusterSpec:
    """Engine instances, routing and L3 of configuration ``config`` of ``exp``."""
    cfg = config_spec(exp, config)
    pcost, dcost = _costs(exp)
    bs = exp.get("block_size", 512)
    pf, dc = exp["prefill"], exp["decode"]
    psched = SchedulerConfig(max_num_batched_tokens=pf.get("max_num_batched_tokens", 16384),
                             max_num_seqs=pf.get("max_num_seqs", 24),
                             max_prefill_chunk_tokens=pf.get("max_prefill_chunk_tokens", 16384), block_size=bs)
    dsched = SchedulerConfig(max_num_batched_tokens=dc.get("max_num_batched_tokens", 8192),
                             max_num_seqs=dc.get("max_num_seqs", 24),
                             max_prefill_chunk_tokens=dc.get("max_prefill_chunk_tokens", 8192), block_size=bs)
    l2 = int(pf.get("l2_bytes", 0))
    insts = []
    for role, n in ((Role.PRE_PREFILL, cfg.get("pre_prefill", 0)), (Role.PREFILL, cfg.get("prefill", 0))):
        for _ in range(int(n)):
            insts.append(EngineInstanceSpec(str(role), pcost, psched, max(1, pcost.kv_capacity_tokens // bs), l2))
    for _ in range(int(cfg.get("decode", 0)) * dc.get("ranks_per_node", 4)):
        insts.append(EngineInstanceSpec(str(Role.DECODE), dcost, dsched, max(1, dcost.kv_capacity_tokens // bs), 0))
    elastic = None
    if cfg.get("elastic"):
        from cpd.policy.roles import PlannerConfig
        elastic = PlannerConfig(**cfg["elastic"])
    return EngineClusterSpec(tuple(insts), routing_config(exp, cfg), router_cost(exp, pcost), bs,
                             int(cfg.get("l3_bytes", exp.get("l3_bytes", 0))), exp.get("kv_event_delay_s", 0.05),
                             elastic=elastic, learn_router_cost=exp.get("router_cost") in ("learned", "learned-fit"),
                             fit_router_cost=exp.get("router_cost") == "learned-fit",
                             l3_events_next_flush=exp.get("l3_events", "step-end") == "next-flush",
                             idle_flush_s=float(exp.get("idle_flush_s", 0.05)),
                             queue_remaining=bool(exp.get("queue_remaining", False)))


def num_gpus(cluster: EngineClusterSpec) -> int:
    return sum(i.cost.tp for i in cluster.instances)


def router_cost(exp: dict, pcost: RooflineCostModel):
    """The cost model the *router* sees (the instances' step times always use the roofline).

    ``exp["router_cost"]``: ``"learned"``: the ``"linear"`` model below as the start, then learned
    from the simulated prefills as the live router learns it (``cpd.router.estimates``: the scale,
    EWMA, in the shape's units; :attr:`EngineClusterSpec.learn_router_cost`); ``"learned-fit"``:
    the same with the fitted overhead + per-token + attention terms (``router.prefill_cost_fit``);
    ``"linear"``: a :class:`~cpd.policy.routing.LinearCostModel` with the shape of the roofline's
    architecture (``attn_coeff``, what a live worker advertises) whose scale is fitted to the
    roofline time of a typical warm turn (``workload.turn_suffix`` new tokens on
    ``workload.first_context`` cached) and whose L2 / L3 bandwidths and overheads are the roofline
    links' (:func:`cpd.costmodel.prior.linear_router_cost`); ``"linear-flat"``: the same with
    ``attn_coeff = 0`` (one rate fitted at that turn: it priced a cold 60-100 K-token prompt at
    1.7-2.3x its roofline time; the router cost of the adaptive-grid records before session 18);
    ``"roofline"``: the roofline itself.
    """
    kind = exp.get("router_cost", "roofline")
    if kind == "roofline":
        return pcost
    if kind not in ("linear", "linear-flat", "learned", "learned-fit"):
        raise ValueError(f"unknown router_cost {kind!r}")
    w = exp.get("workload", {})
    new = int(w.get("turn_suffix", 2000))
    cached = int(w.get("first_context", 100_000))
    return linear_router_cost(pcost, new, cached, shaped=kind != "linear-flat")


def make_workload(exp: dict, total_qps: float, seed: int, overrides: dict | None = None
                  ) -> tuple[list[SimRequest], list]:
    """(requests, prewarm block lists) for one point (``ramp_s + steady_s`` s of arrivals). A trace's
    prompts are truncated to the model's context minus their output (``context_len``, default the
    modeled model's ``max_context``), as the live replay truncates them to the served model's: the
    engines refuse longer prompts (Claude Code sessions reach 424K tokens)."""
    w = dict(exp["workload"])
    w.update(overrides or {})
    kind = w.pop("kind", "agent")
    dur = exp.get("ramp_s", 30) + exp.get("steady_s", 600)
    if kind == "agent":
        names = {f.name for f in fields(AgentWorkload)}
        aw = AgentWorkload(**{k: v for k, v in w.items() if k in names})
        return agent_workload(aw, total_qps, dur, exp.get("ramp_s", 30), seed)
    if kind == "mooncake":  # legacy spelling of {"kind": "trace"} for Mooncake files
        w = {"path": w["path"], "tokens_per_block": w.get("tokens_per_hash_id"),
             "spread_ticks": w.get("spread_ticks_s", 0.0) > 0, "tick_ms": 1000.0 * w.get("spread_ticks_s", 3.0)}
        kind = "trace"
    if kind == "trace":
        if w.get("context_len") is None:  # as the live replay: prompts fit the served model's context
            w["context_len"] = _costs(exp)[0].model.max_context
        return trace_point(w, total_qps, dur, exp.get("block_size", 512), seed), []
    raise ValueError(f"unknown workload kind {kind!r}")


def trace_point(w: dict, total_qps: float, dur: float, sim_block_tokens: int, seed: int) -> list[SimRequest]:
    """A trace at ``total_qps`` with the live replay's arrival model (:mod:`cpd.traces.arrivals`).

    Timed traces (Mooncake, Azure) are time-scaled to ``total_qps``; their one arrival sequence would
    make every seed replay the same requests, so each seed starts at its own request
    (:func:`slice_start`, unless the workload sets ``start``). Claude Code sessions start as
    a Poisson process at ``total_qps / mean requests per session`` (open loop), unless ``users``
    is set (closed loop, ``total_qps`` then ignored). Only requests arriving before ``dur`` (open
    loop) and only the sessions that start before it are converted.
    """
    from cpd.sim.workload import trace_workload
    from cpd.traces import ReplayOptions, poisson_starts

    trace = _read_trace_cached(w["path"])
    names = {f.name for f in fields(ReplayOptions)}
    opts = ReplayOptions(**{k: v for k, v in w.items() if k in names and v is not None})
    opts.seed = seed if "seed" not in w else w["seed"]
    n = trace.num_requests()
    if trace.timed:
        reqs = trace.sessions[0].requests
        natural = len(reqs) / max(1e-9, reqs[-1].t_s - reqs[0].t_s)
        opts.time_scale = total_qps / natural
        if "start" not in w:
            opts.start = slice_start(n, int(total_qps * dur) + 1, opts.seed)
    elif opts.users is None:
        opts.session_rate = total_qps / (n / len(trace.sessions))
        starts = poisson_starts(len(trace.sessions), opts.session_rate, opts.seed)
        opts.max_sessions = max(1, sum(1 for s in starts if s < dur))
    out = trace_workload(trace, opts, sim_block_tokens)
    return out if opts.users is not None else [r for r in out if r.arrival_s < dur]


def slice_start(num_requests: int, num_needed: int, seed: int) -> int:
    """The first request of a timed trace's slice for ``seed``: uniform over the starts that leave
    ``num_needed`` requests (0 when the trace has no more than that; then every seed replays the
    same requests and the seeds' interval has no width)."""
    import random

    room = num_requests - num_needed
    return random.Random(seed).randrange(room + 1) if room > 0 else 0


_TRACES: dict = {}


def _read_trace_cached(path: str):
    """Traces are read once per process (a sweep converts the same trace at every point)."""
    from cpd.traces import read_trace

    if path not in _TRACES:
        _TRACES[path] = read_trace(path)
    return _TRACES[path]


QUICK_WINDOWS: dict[str, Any] = {"ramp_s": 5, "steady_s": 20, "drain_s": 10, "qps_per_gpu": [0.4, 0.8, 1.2],
                                 "search.iters": 1}
"""Overrides for short points sized for a 2-core machine (the adaptive grid's and the sensitivity
study's ``--quick``): 5 s ramp + 20 s of arrivals + 10 s drain, loads 0.4 / 0.8 / 1.2 QPS/GPU,
one bisection step of the saturation search. ~100-300 requests per point: one request is ~0.01 of
goodput."""


def with_overrides(exp: dict, overrides: dict[str, Any]) -> dict:
    """A deep copy of ``exp`` with dotted-path keys set (``workload.cold_fraction``, ``slo.ttft_s``)."""
    e = copy.deepcopy(exp)
    for k, v in overrides.items():
        d = e
        parts = k.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return e


# --------------------------------------------------------------------------- one point
def _busy_by_role(sim: EngineSimulator) -> dict[str, float]:
    return {w.wid: w.busy_s for w in sim.insts}


def run_point(exp: dict, config: str, qps_per_gpu: float, seed: int | None = None,
              overrides: dict | None = None) -> dict[str, Any]:
    """Simulate one (configuration, load, seed) point; its steady-window summary (JSON-ready,
    no wall-clock values: the same inputs give the same dict)."""
    cluster = build_cluster(exp, config)
    gpus = num_gpus(cluster)
    total = qps_per_gpu * gpus
    seed = int(exp.get("seed", 0) if seed is None else seed)
    reqs, prewarm = make_workload(exp, total, seed, overrides)
    ramp, steady = float(exp.get("ramp_s", 30)), float(exp.get("steady_s", 600))
    t1 = ramp + steady
    sim = EngineSimulator(cluster, reqs, stop_s=t1 + exp.get("drain_s", 60), prewarm=prewarm)
    snaps: dict[str, dict[str, float]] = {}
    sim.at(ramp, lambda now: snaps.__setitem__("a", _busy_by_role(sim)))
    sim.at(t1, lambda now: snaps.__setitem__("b", _busy_by_role(sim)))
    sim.run()
    out = summarise(sim, exp, ramp, t1, snaps.get("a", {}), snaps.get("b", _busy_by_role(sim)))
    out.update({"config": config, "qps_per_gpu": rnd(qps_per_gpu), "qps_total": rnd(total), "seed": seed,
                "num_gpus": gpus, "simulated_s": rnd(sim.now), "events": sim.events_run,
                "role_changes": sim.role_changes})
    return out


def summarise(sim: EngineSimulator, exp: dict, ramp: float, t1: float, busy_a: dict[str, float],
              busy_b: dict[str, float]) -> dict[str, Any]:
    """Steady-window metrics of a finished run (module docstring)."""
    slo = slo_of(exp)
    end = sim.now
    recs = [(i, r) for i, r in enumerate(sim.rec) if r is not None and r["arrival"] < t1]
    recs.sort(key=lambda x: (x[1]["arrival"], x[0]))

    def ttft(r: dict) -> float:
        if r.get("rejected"):
            return end - r["arrival"]
        return (r["ttft_t"] if r["ttft_t"] is not None else end) - r["arrival"]
    cut = mser5([ttft(r) for _, r in recs])
    t_warm = max(ramp, recs[cut][1]["arrival"] if cut < len(recs) else t1)
    no_steady = cut >= len(recs) // 2 and len(recs) >= 2 * 5
    win = [(i, r) for i, r in recs if r["arrival"] >= t_warm]
    closed = any(q.deps() for q in sim.reqs)
    scheduled = sum(1 for q in sim.reqs if t_warm <= q.arrival_s < t1)
    good = 0
    tt: list[float] = []
    tp: list[float] = []
    tt_w: list[float] = []
    tt_c: list[float] = []
    hit = {"l1": 0, "l2": 0, "l3": 0}
    prompt = cold = first = rejected = 0
    pools: dict[str, int] = {}
    for i, r in win:
        q = sim.reqs[i]
        prompt += q.prompt_tokens
        if r.get("rejected"):
            rejected += 1
            continue
        t = ttft(r)
        tt.append(t)
        (tt_c if r["cls"] == "cold" else tt_w).append(t)
        cold += r["cls"] == "cold"
        pools[r["pool"]] = pools.get(r["pool"], 0) + 1
        for k in hit:
            hit[k] += r.get(k, 0)
        if r["ttft_t"] is None:
            continue
        first += 1
        tpot = None
        if r["done_t"] is not None and q.output_tokens > 1:
            tpot = (r["done_t"] - r["ttft_t"]) / (q.output_tokens - 1)
            tp.append(tpot)
        ok_tpot = q.output_tokens <= 1 and r["done_t"] is not None or tpot is not None and tpot <= slo["tpot_s"]
        good += t <= slo["ttft_s"] and ok_tpot
    n = len(win)
    denom = max(n, scheduled) if closed else n
    span = max(1e-9, t1 - ramp)
    busy: dict[str, list[float]] = {}
    for w in sim.insts:
        busy.setdefault(str(w.role), []).append((busy_b.get(w.wid, 0.0) - busy_a.get(w.wid, 0.0)) / span)
    q3 = (("p50", .5), ("p90", .9), ("p99", .99))
    return {
        "requests": n, "warmup_s": rnd(t_warm - 0.0), "warmup_rule": "max(ramp_s, MSER-5 on TTFT)",
        "no_steady_state": no_steady,
        "arrival_ratio": rnd(min(1.0, n / scheduled) if (closed and scheduled) else 1.0),
        "goodput": rnd(good / denom if denom else 0.0),
        "goodput_qps_per_gpu": rnd(good / max(1e-9, t1 - t_warm) / max(1, sum(i.cost.tp for i in sim.c.instances))),
        "rejected": rejected,
        "completion_ratio": rnd(first / n if n else 0.0),
        "cold_fraction": rnd(cold / n if n else 0.0),
        "pool_share": {k: rnd(v / n) for k, v in sorted(pools.items())},
        "ttft_s": {k: rnd(pct(tt, x)) for k, x in q3},
        "ttft_warm_s": {k: rnd(pct(tt_w, x)) for k, x in q3},
        "ttft_cold_s": {k: rnd(pct(tt_c, x)) for k, x in q3},
        "tpot_s": {k: rnd(pct(tp, x)) for k, x in (("p50", .5), ("p90", .9))},
        "hit_ratio": {k.upper(): rnd(v / prompt if prompt else 0.0) for k, v in hit.items()},
        "busy_fraction": {k: rnd(sum(v) / len(v), 4) for k, v in sorted(busy.items())},
    }
