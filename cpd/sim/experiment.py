"""Experiments: build clusters from an experiment file, run sweeps, summarise, find saturation.

Experiment file (JSON), see ``cpd/sim/experiments/reference_b200.json``::

    {"name", "model", "gpu", "kv_dtype_bytes", "weight_bytes_per_param", "efficiency": {...},
     "block_size", "kv_event_delay_s", "l3_bytes", "cold_threshold", "router_cost": "linear" | "roofline",
     "prefill": {"tp", "max_num_batched_tokens", "max_prefill_chunk_tokens", "max_num_seqs", "l2_bytes"},
     "decode":  {"tp", "ranks_per_node", "max_num_seqs"},
     "configs": {"2P1D": {"topology": "pd", "pre_prefill": 0, "prefill": 2, "decode": 1}, ...},
     "workload": {"kind": "agent", ...AgentWorkload fields} | {"kind": "mooncake", "path", ...},
     "qps_per_gpu": [...], "ramp_s", "steady_s", "drain_s", "seed",
     "slo": {"ttft_p90_s", "min_completion_ratio"}}

Normalisation: ``QPS/GPU = offered total QPS / all GPUs of the configuration`` (pre-prefill,
prefill and decode GPUs). Each sweep point offers ``qps_per_gpu * num_gpus`` requests/s.

Saturation rule: a point *keeps up* when (a) TTFT p90 over the steady window <= ``slo.ttft_p90_s``
and (b) at least ``slo.min_completion_ratio`` of the window's requests got their first token
before the window closed + ``drain_s``, and (closed-loop workloads) at least that fraction of
the offered requests actually arrived in the window (turns wait for the previous answer, so
an overloaded cluster receives fewer). The saturation QPS/GPU is where the TTFT p90 curve
crosses the SLO, linearly interpolated between the last point that keeps up and the first
that does not (a point failing (b) counts as TTFT p90 = infinity: the crossing is then
that point's load); if every point keeps up it is reported as ">= the largest point".
"""
from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

from cpd.engine.scheduler import SchedulerConfig
from cpd.policy.cost_model import Efficiency, RooflineCostModel
from cpd.policy.routing import ROLE_DECODE, ROLE_PRE_PREFILL, ROLE_PREFILL, LinearCostModel, RoutingConfig
from cpd.sim.simulator import ClusterSpec, InstanceSpec, Simulator
from cpd.sim.workload import AgentWorkload, SimRequest, agent_workload

EXPERIMENTS_DIR = Path(__file__).parent / "experiments"


def load_experiment(path: str | Path) -> dict:
    """Read an experiment JSON (a path or a shipped name such as ``reference_b200``)."""
    p = Path(path)
    if not p.is_file():
        p = EXPERIMENTS_DIR / f"{path}.json"
    return json.loads(p.read_text())


def build_cluster(exp: dict, config: str, exact_decode: bool = False) -> ClusterSpec:
    """Cluster for one named configuration of ``exp`` (see module docstring)."""
    cfg = exp["configs"][config]
    eff = Efficiency(**exp.get("efficiency", {}))
    common = dict(kv_dtype_bytes=exp.get("kv_dtype_bytes", 2),
                  weight_bytes_per_param=exp.get("weight_bytes_per_param", 2),
                  fp8_compute=exp.get("fp8_compute", False), eff=eff)
    bs = exp.get("block_size", 512)
    pf, dc = exp["prefill"], exp["decode"]
    pcost = RooflineCostModel.build(exp["model"], exp["gpu"], tp=pf.get("tp", 4), **common)
    dcost = RooflineCostModel.build(exp["model"], exp["gpu"], tp=dc.get("tp", 1), **common)
    psched = SchedulerConfig(max_num_batched_tokens=pf.get("max_num_batched_tokens", 16384),
                             max_num_seqs=pf.get("max_num_seqs", 24),
                             max_prefill_chunk_tokens=pf.get("max_prefill_chunk_tokens", 16384), block_size=bs)
    dsched = SchedulerConfig(max_num_batched_tokens=dc.get("max_num_batched_tokens", 8192),
                             max_num_seqs=dc.get("max_num_seqs", 24), max_prefill_chunk_tokens=1, block_size=bs)
    block_bytes = bs * pcost.kv_bytes_per_token
    l2 = int(pf.get("l2_bytes", 0) // block_bytes)
    l3 = int(cfg.get("l3_bytes", exp.get("l3_bytes", 0)) // block_bytes)
    wl3 = cfg.get("write_l3", {"pre-prefill": True, "prefill": True})
    insts = []
    for role, n in ((ROLE_PRE_PREFILL, cfg.get("pre_prefill", 0)), (ROLE_PREFILL, cfg.get("prefill", 0))):
        for _ in range(n):
            insts.append(InstanceSpec(role, pcost, psched, None, l2, bool(wl3.get(role, False)) and l3 > 0))
    for _ in range(cfg.get("decode", 0) * dc.get("ranks_per_node", 4)):
        insts.append(InstanceSpec(ROLE_DECODE, dcost, dsched, None, 0, False))
    rc = RoutingConfig(topology=cfg.get("topology", "cpd"), cold_threshold=exp.get("cold_threshold", 0.5),
                       block_size=bs)
    return ClusterSpec(tuple(insts), rc, router_cost(exp, pcost), bs, l3, exp.get("kv_event_delay_s", 0.05),
                       exact_decode)


def router_cost(exp: dict, pcost: RooflineCostModel):
    """The cost model the *router* sees (the instances' step times always use the roofline).

    ``exp["router_cost"]``:

    * ``"linear"`` (what the live router uses, ``cpd.router.estimates``): a
      :class:`~cpd.policy.routing.LinearCostModel` with ``attn_coeff = 0``, whose prefill rate
      is the roofline rate of a typical warm turn (``workload.turn_suffix`` new tokens on
      ``workload.first_context`` cached, i.e. what the live EWMA of computed tokens / compute
      time converges to on a mostly-warm mix) and whose L2 / L3 bandwidths and overheads are
      the roofline links'. Queued tokens are then worth ``tokens / rate``.
    * ``"roofline"``: the roofline itself. Note that the policy prices a worker's queue as
      ``prefill_time_s(queued_tokens, 0)``, i.e. as *one* sequence, so the attention term makes
      two queued 100 K-token prefills look ≈1.6x as long as they take; the router then
      prefers recomputing a warm prefix elsewhere more often than the live router would.
    """
    kind = exp.get("router_cost", "roofline")
    if kind == "roofline":
        return pcost
    if kind != "linear":
        raise ValueError(f"unknown router_cost {kind!r}")
    w = exp.get("workload", {})
    new = int(w.get("turn_suffix", 2000))
    cached = int(w.get("first_context", 100_000))
    rate = new / pcost.prefill_time_s(new, cached)
    return LinearCostModel(kv_bytes_per_token=pcost.kv_bytes_per_token, prefill_tokens_per_s=rate, attn_coeff=0.0,
                           l2_bytes_per_s=pcost.link_bytes_per_s("L2"), l3_bytes_per_s=pcost.link_bytes_per_s("L3"),
                           l2_overhead_s=pcost.link_latency_s("L2"), l3_overhead_s=pcost.link_latency_s("L3"))


def make_workload(exp: dict, total_qps: float, seed: int, overrides: dict | None = None
                  ) -> tuple[list[SimRequest], list]:
    """(requests, prewarm block lists) for one sweep point (``ramp_s + steady_s`` s of arrivals)."""
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
        return trace_point(w, total_qps, dur, exp.get("block_size", 512), seed), []
    raise ValueError(f"unknown workload kind {kind!r}")


def trace_point(w: dict, total_qps: float, dur: float, sim_block_tokens: int, seed: int) -> list[SimRequest]:
    """A trace at ``total_qps`` with the live replay's arrival model (:mod:`cpd.traces.arrivals`).

    Timed traces (Mooncake, Azure) are time-scaled to ``total_qps``. Claude Code sessions start as
    a Poisson process at ``total_qps / mean requests per session`` (open loop), unless ``users``
    is set (closed loop, ``total_qps`` then ignored). Only requests arriving before ``dur`` (open
    loop) and only the sessions that start before it are converted.
    """
    from dataclasses import fields as dfields

    from cpd.sim.workload import trace_workload
    from cpd.traces import ReplayOptions, poisson_starts

    trace = _read_trace_cached(w["path"])
    names = {f.name for f in dfields(ReplayOptions)}
    opts = ReplayOptions(**{k: v for k, v in w.items() if k in names and v is not None})
    opts.seed = seed if "seed" not in w else w["seed"]
    n = trace.num_requests()
    if trace.timed:
        reqs = trace.sessions[0].requests
        natural = len(reqs) / max(1e-9, reqs[-1].t_s - reqs[0].t_s)
        opts.time_scale = total_qps / natural
    elif opts.users is None:
        opts.session_rate = total_qps / (n / len(trace.sessions))
        starts = poisson_starts(len(trace.sessions), opts.session_rate, opts.seed)
        opts.max_sessions = max(1, sum(1 for s in starts if s < dur))
    out = trace_workload(trace, opts, sim_block_tokens)
    return out if opts.users is not None else [r for r in out if r.arrival_s < dur]


_TRACES: dict = {}


def _read_trace_cached(path: str):
    """Traces are read once per process (a sweep converts the same trace at every point)."""
    from cpd.traces import read_trace

    if path not in _TRACES:
        _TRACES[path] = read_trace(path)
    return _TRACES[path]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    f = math.floor(k)
    c = min(len(xs) - 1, f + 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def _r(x: float, nd: int = 6) -> float | None:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return round(float(x), nd)


# (prefill tokens, decode tokens, link bytes by "<role>.<link>"): totals so far, or over a window
_TokenCounts = tuple[int, int, dict[str, float]]


def summarise(sim: Simulator, t0: float, t1: float, num_gpus: int,
              win_tokens: _TokenCounts | None = None) -> dict[str, Any]:
    """Metrics over requests arriving in ``[t0, t1)`` (the steady window). Times in s.

    ``win_tokens``: tokens computed and link bytes moved during the window (from two
    :func:`_snapshot` s); without it the throughput and link-bytes metrics are left out."""
    end = sim.now
    win = [(i, rec) for i, rec in enumerate(sim.rec) if rec is not None and t0 <= rec[0] < t1]
    n = len(win)
    ttft, ttft_w, ttft_c, tpot = [], [], [], []
    done_first = 0
    qpool: dict[str, list[float]] = {}
    qwarm: list[float] = []
    qcold: list[float] = []
    hit = {"L1": 0, "L2": 0, "L3": 0}
    prompt = 0
    stale = 0
    cold = 0
    for i, rec in win:
        r = sim.reqs[i]
        prompt += r.prompt_tokens
        hit["L1"] += rec[4]
        hit["L2"] += rec[5]
        hit["L3"] += rec[6]
        stale += rec[12]
        t = (rec[7] - rec[0]) if rec[7] is not None else (end - rec[0])
        if rec[7] is not None:
            done_first += 1
        ttft.append(t)
        if rec[1] == "cold":
            cold += 1
            ttft_c.append(t)
        else:
            ttft_w.append(t)
        if rec[8] is not None and rec[7] is not None and r.output_tokens > 1:
            tpot.append((rec[8] - rec[7]) / (r.output_tokens - 1))
        if rec[9] is not None:
            qpool.setdefault(rec[2], []).append(rec[9])
            (qwarm if rec[1] == "warm" else qcold).append(rec[9])
        if rec[10] is not None:
            qpool.setdefault("decode", []).append(rec[10])
    span = t1 - t0
    pre = [w for w in sim.insts if w.role != ROLE_DECODE]
    dec = [w for w in sim.insts if w.role == ROLE_DECODE]
    pgpus = sum(w.cost.tp for w in pre) or 1
    dgpus = sum(w.cost.tp for w in dec) or 1
    sched = sum(1 for r in sim.reqs if t0 <= r.arrival_s < t1)
    out: dict[str, Any] = {
        "requests": n,
        "arrival_ratio": _r(min(1.0, n / sched) if sched else 1.0),
        "deferred_turns": sim.deferred,
        "completion_ratio": _r(done_first / n if n else 0.0),
        "cold_fraction": _r(cold / n if n else 0.0),
        "ttft_s": {k: _r(_pct(ttft, q)) for k, q in (("p50", .5), ("p90", .9), ("p99", .99))},
        "ttft_warm_s": {k: _r(_pct(ttft_w, q)) for k, q in (("p50", .5), ("p90", .9), ("p99", .99))},
        "ttft_cold_s": {k: _r(_pct(ttft_c, q)) for k, q in (("p50", .5), ("p90", .9), ("p99", .99))},
        "tpot_s": {k: _r(_pct(tpot, q)) for k, q in (("p50", .5), ("p90", .9))},
        "hit_ratio": {k: _r(v / prompt if prompt else 0.0) for k, v in hit.items()},
        "stale_blocks": stale,
        "queue_s": {p: {"mean": _r(sum(v) / len(v)), "p90": _r(_pct(v, .9))} for p, v in sorted(qpool.items())},
        # prefill-side queue time (loaded -> admitted) by request class: head-of-line blocking
        # of warm requests behind cold prefills shows up in queue_warm_s
        "queue_warm_s": {"mean": _r(sum(qwarm) / len(qwarm)) if qwarm else None, "p90": _r(_pct(qwarm, .9))},
        "queue_cold_s": {"mean": _r(sum(qcold) / len(qcold)) if qcold else None, "p90": _r(_pct(qcold, .9))},
    }
    if win_tokens is not None:
        pt, dt, lb = win_tokens
        out["prefill_tokens_per_s_per_gpu"] = _r(pt / span / pgpus, 3)
        out["decode_tokens_per_s_per_gpu"] = _r(dt / span / dgpus, 3)
        out["link_bytes"] = {k: int(v) for k, v in sorted(lb.items())}
    return out


def _snapshot(sim: Simulator) -> _TokenCounts:
    pt = sum(w.tokens for w in sim.insts if w.role != ROLE_DECODE)
    dt = sum(w.tokens for w in sim.insts if w.role == ROLE_DECODE)
    lb: dict[str, float] = {}
    for w in sim.insts:
        for l in (w.pcie, w.nic):
            kind = l.name.split(".")[1]
            key = f"{w.role}.{kind}"
            lb[key] = lb.get(key, 0.0) + l.bytes_total
    return pt, dt, lb


def run_point(exp: dict, config: str, qps_per_gpu: float, overrides: dict | None = None,
              exact_decode: bool = False, on_progress: Callable[[float], None] | None = None) -> dict[str, Any]:
    """Simulate one (configuration, load) point and return its summary (JSON-ready)."""
    cluster = build_cluster(exp, config, exact_decode)
    total = qps_per_gpu * cluster.num_gpus
    seed = int(exp.get("seed", 0))
    reqs, prewarm = make_workload(exp, total, seed, overrides)
    ramp, steady = exp.get("ramp_s", 30), exp.get("steady_s", 600)
    t0, t1 = float(ramp), float(ramp + steady)
    sim = Simulator(cluster, reqs, stop_s=t1 + exp.get("drain_s", 60), on_progress=on_progress, prewarm=prewarm)
    snaps: dict[str, _TokenCounts] = {}
    sim.at(t0, lambda now: snaps.__setitem__("a", _snapshot(sim)))
    sim.at(t1, lambda now: snaps.__setitem__("b", _snapshot(sim)))
    sim.run()
    a, b = snaps.get("a"), snaps.get("b", _snapshot(sim))
    win: _TokenCounts | None = None
    if a is not None:
        win = (b[0] - a[0], b[1] - a[1], {k: b[2][k] - a[2].get(k, 0) for k in b[2]})
    s = summarise(sim, t0, t1, cluster.num_gpus, win_tokens=win)
    s.update({"config": config, "qps_per_gpu": _r(qps_per_gpu), "qps_total": _r(total),
              "num_gpus": cluster.num_gpus, "simulated_s": _r(sim.now), "events": sim.events_run})
    return s


def saturation(points: list[dict], slo_p90: float, min_completion: float) -> dict[str, Any]:
    """Apply the saturation rule (module docstring) to one configuration's sorted points."""
    pts = sorted(points, key=lambda p: p["qps_per_gpu"])
    prev = None
    for p in pts:
        p90 = p["ttft_s"]["p90"]
        ok_c = p["completion_ratio"] >= min_completion and p.get("arrival_ratio", 1.0) >= min_completion
        if p90 is None or not ok_c or p90 > slo_p90:
            if prev is None:
                return {"qps_per_gpu": None, "bounded": "below", "first_fail": p["qps_per_gpu"]}
            x0, y0 = prev["qps_per_gpu"], prev["ttft_s"]["p90"]
            x1 = p["qps_per_gpu"]
            if ok_c and p90 is not None and p90 > y0:
                x = x0 + (x1 - x0) * (slo_p90 - y0) / (p90 - y0)
            else:
                x = x1 if not ok_c else x0
            return {"qps_per_gpu": _r(x, 4), "qps_total": _r(x * p["num_gpus"], 4), "bounded": "interpolated",
                    "last_ok": x0, "first_fail": x1}
        prev = p
    last = pts[-1]
    return {"qps_per_gpu": last["qps_per_gpu"], "qps_total": _r(last["qps_per_gpu"] * last["num_gpus"], 4),
            "bounded": "at-least", "last_ok": last["qps_per_gpu"], "first_fail": None}
