"""Does a live modeled deployment rank the configurations as the simulator does? (issue 11)

For each workload point, the SAME request list runs through

(a) the engine-object simulator (:class:`cpd.sim.engine_sim.EngineSimulator`: real engines on a
    virtual clock with the modeled executor, the live router's prefix index and ``route``), and
(b) a live modeled deployment (:class:`cpd.deploy.Deployment`: real router and worker processes,
    HTTP, the L3 file store, the KV handoff; ``engine.executor=modeled``, every modeled wait
    K× longer — ``engine.time_dilation`` — and requests sent at ``arrival_s × K``; live times
    are divided by K),

for each configuration of :data:`cpd.sim.experiment.NAMED_CONFIGS` on the same 3 GPUs:
``pd`` (2 prefill + 1 decode, local prefix caches, nothing written to L3), ``pd-l3`` (the same,
every computed block written through to L3), ``cpd-static`` (1 pre-prefill + 1 prefill +
1 decode, reuse-ratio classes, cold prompts written through) and ``cpd`` (the same GPUs,
adaptive routing; shown as ``cpd-adaptive``).

Same on both sides: cost model (shape, GPU, TP), block size, scheduler budgets, L1 blocks, L2
bytes, L3 (unbounded), the router's :class:`~cpd.policy.routing.RoutingConfig` (built by
:func:`cpd.config.routing_config` from the live config; the sim's SLOs are the live ones / K).
The router's cost model (``--router-cost``): live, :class:`cpd.router.estimates.CostEstimates`
(EWMA of the measured prefill rate and load bandwidths, or with ``router.prefill_cost_fit`` the
fitted prefill terms, starting from the workers' advertised :class:`~cpd.messages.worker_api.CostPrior`
over the ``LinearCostModel`` defaults). Simulated, by default (``learned``) the same: the same
``CostEstimates`` and fit setting (the live config's ``router.prefill_cost_fit``), the same start
(every simulated instance advertises its CostPrior, :func:`cpd.sim.engine_sim.instance_cost_prior`;
the defaults' load overheads / K), fed the same observations (each prefill answer's compute time
and step figures, and the worker's L2/L3 loads since its last answer; the simulated load seconds
are the modeled waits, the live ones add the real store read and copy): see
:attr:`cpd.sim.engine_sim.EngineClusterSpec.learn_like_live`. ``fixed`` (the figures published
before 2026-12-03 12:00): a fixed ``LinearCostModel`` with the roofline's rate of a typical cold
prompt (``--system-prompt`` + ``--first-context`` tokens) and the roofline's L2/L3 links and
latencies. A third side, **mirror**, reruns the simulator with the live router's end-of-run
estimates (× K) as a fixed cost model: it tells a difference of the router's inputs from a
difference of the simulated mechanism. Each side's end-of-run estimates are in the results
(``router_cost_end``, modeled units).

When the router learns that a write-through block is in L3 (``--l3-events``): ``step-end``
(default), with the events of the step that computed it, ``kv_event_delay`` later; ``next-flush``,
with the worker's next event flush, as the live worker loop does (after its next step, or 0.05 s
wall / K after the step when idle; :attr:`cpd.sim.engine_sim.EngineClusterSpec.l3_events_next_flush`).

Metrics over the requests arriving in ``[warm_s, duration_s)`` (the same requests on both sides):
goodput (share with TTFT ≤ ``slo_ttft_s`` and TPOT ≤ ``slo_tpot_s``; failed requests fail), TTFT
p50/p90 (all, warm, cold), TPOT p50, pool and class shares, and the per-request class+pool
agreement. Live TTFT is the router's (``/cpd/requests`` ``ttft_s``, from its receipt of the
request to the prefill's answer); TPOT is ``(finish - TTFT) / (tokens - 1)`` with the finish the
client's arrival time of the chunk carrying the finish reason and tokens the stream's
``usage.completion_tokens``; all / K.

Ordering (each side on its own): configurations are compared pairwise: ``a`` beats ``b`` when
its goodput is higher by more than the noise (2 binomial standard errors of the difference, at least ``--goodput-tol``),
or, goodputs tied, its TTFT p90 is lower by more than ``--ttft-tol`` (relative); otherwise
they tie. A pair agrees when both sides give the same relation, is *soft* when one side ties
and the other does not, and disagrees when the sides order it oppositely.

Usage::

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/modeled_ordering.py \\
        --points 3,4.5,6 --duration 30 --json docs/results/modeled_ordering/result.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cpd.config import Config, build_config, routing_config  # noqa: E402
from cpd.engine.scheduler import SchedulerConfig  # noqa: E402
from cpd.policy.cost_model import RooflineCostModel  # noqa: E402
from cpd.policy.routing import LinearCostModel, RoutingConfig  # noqa: E402
from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator, request_tokens  # noqa: E402
from cpd.sim.experiment import NAMED_CONFIGS  # noqa: E402
from cpd.sim.stats import pct, rnd  # noqa: E402
from cpd.sim.workload import AgentWorkload, SimRequest, agent_workload  # noqa: E402

CONFIGS = ("pd", "pd-l3", "cpd-static", "cpd")
LABEL = {"cpd": "cpd-adaptive"}
POOLS = ("pre-prefill", "prefill", "decode")


# --------------------------------------------------------------------------- setup
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default="3,4.5,6", help="offered loads, total QPS of the modeled hardware")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--duration", type=float, default=30.0, help="modeled seconds of arrivals per point")
    p.add_argument("--warm", type=float, default=None, help="measure requests arriving from here (default "
                                                            "duration / 4)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-dilation", type=float, default=3.0, help="K of the live run")
    p.add_argument("--shape", default="Llama-3.1-70B")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--l1-blocks", type=int, default=1024, help="L1 KV blocks per worker")
    p.add_argument("--l2-bytes", type=int, default=16 << 30, help="L2 host bytes per prefill-side worker "
                                                                  "(modeled)")
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens = max_prefill_chunk_tokens")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, modeled seconds")
    p.add_argument("--slo-tpot", type=float, default=0.15, help="TPOT SLO, modeled seconds")
    p.add_argument("--cold-fraction", type=float, default=0.15)
    p.add_argument("--system-prompt", type=int, default=1024)
    p.add_argument("--first-context", type=int, default=3000)
    p.add_argument("--turn-suffix", type=int, default=400)
    p.add_argument("--max-context", type=int, default=14000)
    p.add_argument("--compacted-context", type=int, default=3000)
    p.add_argument("--min-turn-gap", type=float, default=3.0)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--sim-l3-bytes-per-s", type=float, default=0.0,
                   help="sim: the router's L3 bandwidth estimate (modeled B/s; 0 = the roofline link's). A "
                        "sensitivity check: the live estimate of a modeled deployment is not the link's (README)")
    p.add_argument("--router-cost", choices=("learned", "fixed"), default="learned",
                   help="sim: the router's cost model: learned as the live router learns it (default), or the "
                        "fixed roofline model of the figures published before 2026-12-03 12:00")
    p.add_argument("--l3-events", choices=("step-end", "next-flush"), default="step-end",
                   help="sim: when a write-through's L3 events reach the router: with the computing step's "
                        "(step-end) or with the worker's next event flush, as live (next-flush; "
                        "EngineClusterSpec.l3_events_next_flush, idle flush 0.05 s wall / K)")
    p.add_argument("--kv-event-delay", type=float, default=0.01, help="sim: router index lag (modeled s)")
    p.add_argument("--goodput-tol", type=float, default=0.03)
    p.add_argument("--ttft-tol", type=float, default=0.10)
    p.add_argument("--sim-only", action="store_true")
    p.add_argument("--log-dir", default="", help="keep the live deployments' logs here (one folder per run)")
    p.add_argument("--json", default="", help="write the results here")
    return p.parse_args(argv)


def workload(a: argparse.Namespace, qps: float) -> list[SimRequest]:
    """Open-loop agent sessions (:func:`cpd.sim.workload.agent_workload`, no prewarm): new sessions
    bring a shared system prompt plus their own context (cold); turns of existing sessions reuse
    the whole previous prompt and add the previous output and a suffix (warm)."""
    w = AgentWorkload(cold_fraction=a.cold_fraction, first_context=a.first_context, first_context_jitter=0.3,
                      turn_suffix=a.turn_suffix, output_tokens=a.output_tokens, output_jitter=0.0,
                      system_prompt=a.system_prompt, max_context=a.max_context,
                      compacted_context=a.compacted_context, min_turn_gap_s=a.min_turn_gap, prewarm=False,
                      closed_loop=False, block_size=a.block_size)
    return agent_workload(w, qps, a.duration, 0.0, a.seed)[0]


def live_config(a: argparse.Namespace, name: str, model_dir: str) -> Config:
    """The live deployment of configuration ``name`` (:data:`NAMED_CONFIGS`) on 3 GPUs."""
    spec = NAMED_CONFIGS[name]
    k = a.time_dilation
    cpd = spec["topology"] == "cpd"
    o: dict[str, Any] = {
        "model.dir": model_dir, "router.port": 0, "deployment.supervise": False,
        "engine.executor": "modeled", "engine.hardware": a.gpu, "engine.model_shape": a.shape, "engine.tp": a.tp,
        "engine.time_dilation": k, "engine.block_size": a.block_size, "engine.num_blocks": a.l1_blocks,
        "engine.max_num_batched_tokens": a.budget, "engine.max_prefill_chunk_tokens": a.budget,
        "engine.max_num_seqs": a.max_num_seqs, "kv.host_kv_bytes": a.l2_bytes, "kv.l3_capacity_bytes": 0,
        "handoff.arena_bytes": 64 << 20,
        "deployment.topology": spec["topology"], "deployment.num_pre_prefill": 1 if cpd else 0,
        "deployment.num_prefill": 1 if cpd else 2, "deployment.num_decode": 1,
        "router.routing_mode": spec.get("mode", "static"),
        "router.ttft_slo_s": a.slo_ttft * k, "router.tpot_slo_s": a.slo_tpot * k,
    }
    if spec.get("write_through") is not None:
        o["router.write_through"] = spec["write_through"]
    return build_config(overrides=o)


def sim_routing(cfg: Config, k: float) -> RoutingConfig:
    """The live router's RoutingConfig with its times (wall seconds of a K× dilated run) / K."""
    r = routing_config(cfg)
    return replace(r, ttft_slo_s=r.ttft_slo_s / k, tpot_slo_s=r.tpot_slo_s / k,
                   heavy_uncached_s=None if r.heavy_uncached_s is None else r.heavy_uncached_s / k,
                   raw_wait_max_s=r.raw_wait_max_s / k)


def router_cost(a: argparse.Namespace, cost: RooflineCostModel, live_end: dict | None = None) -> LinearCostModel:
    """The simulated router's cost model (module docstring): roofline rate of a typical cold prompt
    and the roofline's L2/L3 links; ``live_end`` (the *mirror* run): the live router's EWMA values
    at the end of its run instead (modeled units, :func:`_cost_gauges`)."""
    n = a.system_prompt + a.first_context
    m = LinearCostModel(kv_bytes_per_token=cost.kv_bytes_per_token, prefill_tokens_per_s=n / cost.prefill_time_s(n, 0),
                        l2_bytes_per_s=cost.link_bytes_per_s("L2"),
                        l3_bytes_per_s=a.sim_l3_bytes_per_s or cost.link_bytes_per_s("L3"),
                        l2_overhead_s=cost.link_latency_s("L2"), l3_overhead_s=cost.link_latency_s("L3"))
    if live_end:
        m = replace(m, **{k: v for k, v in live_end.items() if v})
    return m


# --------------------------------------------------------------------------- the two sides
def learned_router_base(cost: RooflineCostModel, k: float) -> LinearCostModel:
    """The live router's base cost model (``cpd.router.app``: ``LinearCostModel`` defaults) in
    modeled units (its load overheads are wall seconds of a K× dilated run: / K); the workers'
    advertised priors replace its rates."""
    d = LinearCostModel(kv_bytes_per_token=cost.kv_bytes_per_token)
    return replace(d, l2_overhead_s=d.l2_overhead_s / k, l3_overhead_s=d.l3_overhead_s / k,
                   prefill_overhead_s=d.prefill_overhead_s / k)


def _cost_summary(m: LinearCostModel) -> dict[str, float]:
    return {"prefill_tokens_per_s": rnd(m.prefill_tokens_per_s, 1), "l2_bytes_per_s": rnd(m.l2_bytes_per_s, 0),
            "l3_bytes_per_s": rnd(m.l3_bytes_per_s, 0), "attn_coeff": m.attn_coeff,
            "prefill_overhead_s": m.prefill_overhead_s}


def run_sim(a: argparse.Namespace, name: str, reqs: list[SimRequest], vocab: int, model_dir: str,
            live_end: dict | None = None, info: dict | None = None) -> list[dict]:
    """One configuration in the simulator; a row per request (modeled seconds). ``live_end``: the
    router's cost model from the live run, fixed (:func:`router_cost`); else ``a.router_cost``
    (module docstring). ``info``: gets the router's cost model at the end (``router_cost_end``,
    modeled units) and at the start (``router_cost_start``)."""
    cfg = live_config(a, name, model_dir)
    cost = RooflineCostModel.build(a.shape, a.gpu, a.tp)
    sched = SchedulerConfig(block_size=a.block_size, max_num_batched_tokens=a.budget, max_num_seqs=a.max_num_seqs,
                            max_prefill_chunk_tokens=a.budget)
    sizes = cfg.deployment.pool_sizes()
    insts = [EngineInstanceSpec(role, cost, sched, a.l1_blocks, a.l2_bytes if role != "decode" else 0)
             for role in POOLS for _ in range(sizes[role])]
    l3 = 0 if NAMED_CONFIGS[name].get("l3_bytes") == 0 else 1 << 50
    learn = live_end is None and getattr(a, "router_cost", "learned") == "learned"
    base = learned_router_base(cost, a.time_dilation) if learn else router_cost(a, cost, live_end)
    cl = EngineClusterSpec(tuple(insts), sim_routing(cfg, a.time_dilation), base,
                           a.block_size,
                           l3_bytes=l3, kv_event_delay_s=a.kv_event_delay,
                           raw_ready_margin_s=cfg.router.raw_ready_margin_s / a.time_dilation,
                           learn_router_cost=learn, fit_router_cost=learn and cfg.router.prefill_cost_fit,
                           learn_like_live=learn, l3_events_next_flush=getattr(a, "l3_events", "") == "next-flush",
                           idle_flush_s=0.05 / a.time_dilation)
    sim = EngineSimulator(cl, reqs, vocab_size=vocab)
    start = sim.router_cost_model()
    sim.run()
    if info is not None:
        info["router_cost_start"] = _cost_summary(start)
        info["router_cost_end"] = _cost_summary(sim.router_cost_model())
        if sim.estimates is not None:
            info["router_cost_fit_rms_rel_error"] = sim.estimates.fit_rms_rel_error
    rows = []
    for q, r in zip(sim.reqs, sim.rec):
        assert r is not None
        ttft = None if r.get("ttft_t") is None else r["ttft_t"] - r["arrival"]
        tpot = None
        if r.get("done_t") is not None and r["ttft_t"] is not None and q.output_tokens > 1:
            tpot = (r["done_t"] - r["ttft_t"]) / (q.output_tokens - 1)
        rows.append({"arrival_s": q.arrival_s, "cls": r["cls"], "pool": r["pool"], "ttft_s": ttft, "tpot_s": tpot,
                     "done": r.get("done_t") is not None, "output_tokens": q.output_tokens,
                     "prompt_tokens": q.prompt_tokens, "tiers": {t: r.get(t.lower(), 0) for t in ("L1", "L2", "L3")}})
    return rows


async def _send_all(url: str, model: str, prompts: list[list[int]], reqs: list[SimRequest], k: float,
                    timeout_s: float) -> list[dict]:
    """Send every request at ``arrival_s × k`` (open loop), streaming; per request: the server's
    id, the wall time of the chunk that carries the finish reason (from its send), the generated
    tokens (``usage.completion_tokens``: the stream sends text, and a token without text of its
    own sends no chunk), error."""
    out: list[dict] = [{} for _ in reqs]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, pool=None), limits=limits, trust_env=False) as cl:
        await cl.get(f"{url}/v1/models")  # first connection before the clock starts

        async def one(i: int, t0: float) -> None:
            await asyncio.sleep(max(0.0, t0 + reqs[i].arrival_s * k - time.perf_counter()))
            body = {"model": model, "prompt": prompts[i], "max_tokens": reqs[i].output_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            rec: dict[str, Any] = {"id": None, "finish_s": None, "tokens": 0, "error": None}
            out[i] = rec
            t_send = time.perf_counter()
            rec["send_lag_s"] = t_send - (t0 + reqs[i].arrival_s * k)
            try:
                async with cl.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        rec["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                        return
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                            continue
                        chunk = json.loads(line[5:])
                        rec["id"] = rec["id"] or chunk.get("id")
                        if any(c.get("finish_reason") for c in chunk.get("choices") or ()):
                            rec["finish_s"] = time.perf_counter() - t_send
                        if isinstance(chunk.get("usage"), dict):
                            rec["tokens"] = int(chunk["usage"].get("completion_tokens") or 0)
            except (httpx.HTTPError, ValueError) as e:
                rec["error"] = f"{type(e).__name__}: {e}"

        t0 = time.perf_counter() + 0.5
        await asyncio.gather(*(one(i, t0) for i in range(len(reqs))))
    return out


def reqs_tag(reqs: list[SimRequest]) -> str:
    """A short name of a request list for log folders (``<n>req-<last arrival>s``)."""
    return f"{len(reqs)}req-{reqs[-1].arrival_s:.0f}s" if reqs else "empty"


def _load() -> float:
    return os.getloadavg()[0]


def run_live(a: argparse.Namespace, name: str, reqs: list[SimRequest], prompts: list[list[int]],
             model_dir: str) -> tuple[list[dict], dict]:
    """One configuration live; a row per request (times / K) and run facts."""
    from cpd.deploy import Deployment
    k = a.time_dilation
    t_start = time.monotonic()
    log_dir = str(Path(a.log_dir) / f"{reqs_tag(reqs)}-{name}") if a.log_dir else None
    with Deployment(live_config(a, name, model_dir), log_dir=log_dir) as dep:
        t_ready = time.monotonic()
        load0 = _load()
        sent = asyncio.run(_send_all(dep.url, dep.model_name, prompts, reqs, k, timeout_s=600.0))
        load1 = _load()
        recs = httpx.get(f"{dep.url}/cpd/requests", timeout=30).json()
        metrics = httpx.get(f"{dep.url}/metrics", timeout=30).text
    rows = []
    for q, s in zip(reqs, sent):
        rec = recs.get(s.get("id") or "", None)
        ok = s.get("error") is None and rec is not None
        tpot = None
        if ok and s["tokens"] > 1 and s["finish_s"] is not None and rec["ttft_s"] is not None:
            tpot = (s["finish_s"] - rec["ttft_s"]) / (s["tokens"] - 1) / k
        rows.append({"arrival_s": q.arrival_s, "cls": rec["class"] if rec else None,
                     "pool": rec["pool"] if rec else None,
                     "ttft_s": rec["ttft_s"] / k if ok and rec.get("ttft_s") is not None else None, "tpot_s": tpot,
                     "done": ok and s["tokens"] >= q.output_tokens, "output_tokens": q.output_tokens,
                     "prompt_tokens": q.prompt_tokens, "error": s.get("error"),
                     "send_lag_s": s.get("send_lag_s", 0.0) / k,
                     "tiers": {t: (rec or {}).get("cached_tokens_by_tier", {}).get(t, 0) for t in ("L1", "L2", "L3")}})
    facts = {"startup_s": rnd(t_ready - t_start, 2), "wall_s": rnd(time.monotonic() - t_ready, 2),
             "load_1m_start": rnd(load0, 2), "load_1m_end": rnd(load1, 2),
             "router_cost_end": _cost_gauges(metrics, k)}
    return rows, facts


def _cost_gauges(metrics: str, k: float) -> dict[str, float | None]:
    """The live router's EWMA cost model at the end (rates × K: modeled-hardware units)."""
    out: dict[str, float | None] = {}
    for line in metrics.splitlines():
        if line.startswith("cpd_cost_model_prefill_tokens_per_second"):
            out["prefill_tokens_per_s"] = rnd(float(line.split()[-1]) * k, 1)
        elif line.startswith("cpd_cost_model_bandwidth_bytes_per_second"):
            tier = "L2" if 'tier="L2"' in line else "L3"
            out[f"{tier.lower()}_bytes_per_s"] = rnd(float(line.split()[-1]) * k, 0)
    return out


# --------------------------------------------------------------------------- metrics
def summarise(rows: list[dict], a: argparse.Namespace, warm_s: float) -> dict[str, Any]:
    """Window metrics (module docstring) of one side's rows."""
    win = [r for r in rows if r["arrival_s"] >= warm_s]
    n = len(win)
    tt = [r["ttft_s"] for r in win if r["ttft_s"] is not None]
    tt_w = [r["ttft_s"] for r in win if r["ttft_s"] is not None and r["cls"] == "warm"]
    tt_c = [r["ttft_s"] for r in win if r["ttft_s"] is not None and r["cls"] == "cold"]
    tp = [r["tpot_s"] for r in win if r["tpot_s"] is not None]
    good = sum(1 for r in win if r["ttft_s"] is not None and r["ttft_s"] <= a.slo_ttft and r["done"]
               and (r["output_tokens"] <= 1 or (r["tpot_s"] is not None and r["tpot_s"] <= a.slo_tpot)))
    pools: dict[str, int] = {}
    for r in win:
        pools[str(r["pool"])] = pools.get(str(r["pool"]), 0) + 1
    prompt = sum(r["prompt_tokens"] for r in win) or 1
    return {
        "requests": n, "failed": sum(1 for r in win if r["ttft_s"] is None or not r["done"]),
        "goodput": rnd(good / n if n else 0.0, 4),
        "ttft_s": {"p50": rnd(pct(tt, .5), 4), "p90": rnd(pct(tt, .9), 4)},
        "ttft_warm_s": {"p50": rnd(pct(tt_w, .5), 4), "p90": rnd(pct(tt_w, .9), 4)},
        "ttft_cold_s": {"p50": rnd(pct(tt_c, .5), 4), "p90": rnd(pct(tt_c, .9), 4)},
        "tpot_s": {"p50": rnd(pct(tp, .5), 4), "p90": rnd(pct(tp, .9), 4)},
        "cold_share": rnd(sum(1 for r in win if r["cls"] == "cold") / n if n else 0.0, 4),
        "pool_share": {k: rnd(v / n, 4) for k, v in sorted(pools.items())},
        "hit_ratio": {t: rnd(sum(r["tiers"][t] for r in win) / prompt, 4) for t in ("L1", "L2", "L3")},
    }


def relation(x: dict, y: dict, a: argparse.Namespace) -> int:
    """+1: ``x`` better than ``y``, -1: worse, 0: tied within noise (module docstring)."""
    gx, gy, n = x["goodput"], y["goodput"], max(1, min(x["requests"], y["requests"]))
    se = math.sqrt(max(gx * (1 - gx), gy * (1 - gy), 0.25 / n) * 2 / n)
    tol = max(a.goodput_tol, 2 * se)
    if abs(gx - gy) > tol:
        return 1 if gx > gy else -1
    px, py = x["ttft_s"]["p90"], y["ttft_s"]["p90"]
    if px is None or py is None:
        return 0
    if abs(px - py) > a.ttft_tol * max(px, py):
        return 1 if px < py else -1
    return 0


def ordering(summ: dict[str, dict], a: argparse.Namespace) -> tuple[list[str], dict[str, int]]:
    """Ranked names (wins - losses, then goodput, then TTFT p90) and the pairwise relations."""
    names = list(summ)
    rel = {f"{x}|{y}": relation(summ[x], summ[y], a) for i, x in enumerate(names) for y in names[i + 1:]}
    score = {x: sum(v if p.split("|")[0] == x else -v for p, v in rel.items() if x in p.split("|")) for x in names}
    ranked = sorted(names, key=lambda x: (-score[x], -summ[x]["goodput"], summ[x]["ttft_s"]["p90"] or 1e9))
    return ranked, rel


def compare(sim_rel: dict[str, int], live_rel: dict[str, int]) -> dict[str, Any]:
    """Pairwise agreement of the two sides' relations."""
    out: dict[str, list[str]] = {"agree": [], "soft": [], "disagree": []}
    for p, s in sim_rel.items():
        l_ = live_rel[p]
        out["agree" if s == l_ else "disagree" if s * l_ < 0 else "soft"].append(p)
    return out


def per_request_agreement(sim: list[dict], live: list[dict]) -> float:
    return sum(s["cls"] == l_["cls"] and s["pool"] == l_["pool"] for s, l_ in zip(sim, live)) / max(1, len(sim))


# --------------------------------------------------------------------------- report
def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _shares(d: dict[str, float]) -> str:
    short = {"pre-prefill": "pp", "prefill": "p", "decode": "d"}
    return " ".join(f"{short.get(k, k)}{v:.2f}" for k, v in d.items())


def _rel_sym(v: int) -> str:
    return ">" if v > 0 else "<" if v < 0 else "≈"


def _sides(c: dict, key: str, sub: str | None = None, nd: int = 2) -> str:
    """``sim / mirror / live`` of one metric of one configuration (``-`` where missing)."""
    vals = []
    for side in ("sim", "mirror", "live"):
        v = c.get(side)
        if v is not None:
            v = v.get(key)
            v = v.get(sub) if (sub is not None and isinstance(v, dict)) else v
        vals.append(_f(v, nd))
    return " / ".join(vals)


def _order_line(o: dict, side: str) -> str:
    return " > ".join(LABEL.get(x, x) for x in o.get(f"{side}_ranked", []))


def markdown(res: dict) -> str:
    """Per point: a table (sim / mirror / live per metric) and the orderings."""
    lines = []
    for pt in res["points"]:
        lines.append(f"\n### {pt['qps']:g} QPS ({pt['qps'] / 3:.2f} QPS/GPU): {pt['num_requests']} requests, "
                     f"{pt['window_requests']} measured (arrivals from {pt['warm_s']:g} s)\n")
        lines.append("| config | goodput | TTFT p50 (s) | TTFT p90 (s) | warm-class TTFT p90 | cold-class TTFT p90 "
                     "| L3 hit ratio | pools sim | pools live | cls+pool agree sim / mirror | live load 1m |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, c in pt["configs"].items():
            lines.append(
                f"| {LABEL.get(name, name)} | {_sides(c, 'goodput')} | {_sides(c, 'ttft_s', 'p50')} "
                f"| {_sides(c, 'ttft_s', 'p90')} | {_sides(c, 'ttft_warm_s', 'p90')} "
                f"| {_sides(c, 'ttft_cold_s', 'p90')} | {_sides(c, 'hit_ratio', 'L3')} "
                f"| {_shares(c['sim']['pool_share'])} | {_shares((c.get('live') or {}).get('pool_share', {}))} "
                f"| {_f(c.get('class_pool_agree'))} / {_f(c.get('class_pool_agree_mirror'))} "
                f"| {_f((c.get('live_run') or {}).get('load_1m_end'))} |")
        o = pt["ordering"]
        lines.append("")
        for side in ("sim", "mirror", "live"):
            if f"{side}_ranked" in o:
                lines.append(f"- {side} order: {_order_line(o, side)}")
        pairs = []
        for p, v in o["sim_relations"].items():
            x, y = p.split("|")
            rels = "/".join("-" if o.get(f"{side}_relations", {}).get(p) is None
                            else _rel_sym(o[f"{side}_relations"][p]) for side in ("sim", "mirror", "live"))
            pairs.append(f"{LABEL.get(x, x)} {rels} {LABEL.get(y, y)}")
        lines.append(f"- pairs (sim/mirror/live): {'; '.join(pairs)}")
        for key, what in (("agreement", "sim vs live"), ("agreement_mirror", "mirror vs live")):
            if key in o:
                ag = o[key]
                lines.append(f"- {what}: {len(ag['agree'])} pairs agree, {len(ag['soft'])} soft (tie on one side), "
                             f"{len(ag['disagree'])} disagree"
                             + (f" ({', '.join(ag['disagree'])})" if ag['disagree'] else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def run_point(a: argparse.Namespace, qps: float, names: list[str], vocab: int, model_dir: str) -> dict:
    reqs = workload(a, qps)
    warm_s = a.warm if a.warm is not None else a.duration / 4
    cache: dict = {}
    prompts = [request_tokens(r, a.block_size, cache, vocab) for r in reqs]
    pt: dict[str, Any] = {"qps": qps, "num_requests": len(reqs), "warm_s": warm_s,
                          "window_requests": sum(1 for r in reqs if r.arrival_s >= warm_s),
                          "generated_cold_share": rnd(sum(r.tag == "cold" for r in reqs) / max(1, len(reqs)), 4),
                          "configs": {}}
    for name in names:
        t = time.monotonic()
        info: dict[str, Any] = {}
        sim_rows = run_sim(a, name, reqs, vocab, model_dir, info=info)
        c: dict[str, Any] = {"sim": summarise(sim_rows, a, warm_s), "sim_wall_s": rnd(time.monotonic() - t, 2),
                             "sim_router": info}
        print(f"[{qps:g} QPS] {name}: sim {c['sim']['goodput']} ttft p90 {c['sim']['ttft_s']['p90']} "
              f"({c['sim_wall_s']} s; router cost end {info['router_cost_end']})", flush=True)
        if not a.sim_only:
            live_rows, facts = run_live(a, name, reqs, prompts, model_dir)
            c["live"] = summarise(live_rows, a, warm_s)
            c["live_run"] = facts
            c["live_errors"] = sorted({r["error"] for r in live_rows if r.get("error")})[:5]
            c["live_send_lag_p90_s"] = rnd(pct([r["send_lag_s"] for r in live_rows], .9), 4)
            c["class_pool_agree"] = rnd(per_request_agreement(sim_rows, live_rows), 4)
            mirror_rows = run_sim(a, name, reqs, vocab, model_dir, facts["router_cost_end"])
            c["mirror"] = summarise(mirror_rows, a, warm_s)
            c["class_pool_agree_mirror"] = rnd(per_request_agreement(mirror_rows, live_rows), 4)
            print(f"[{qps:g} QPS] {name}: live {c['live']['goodput']} ttft p90 {c['live']['ttft_s']['p90']} "
                  f"agree {c['class_pool_agree']} {facts}", flush=True)
        pt["configs"][name] = c
    sim_ranked, sim_rel = ordering({n: c["sim"] for n, c in pt["configs"].items()}, a)
    pt["ordering"] = {"sim_ranked": sim_ranked, "sim_relations": sim_rel}
    if not a.sim_only:
        live_ranked, live_rel = ordering({n: c["live"] for n, c in pt["configs"].items()}, a)
        mirror_ranked, mirror_rel = ordering({n: c["mirror"] for n, c in pt["configs"].items()}, a)
        pt["ordering"].update(live_ranked=live_ranked, live_relations=live_rel, agreement=compare(sim_rel, live_rel),
                              mirror_ranked=mirror_ranked, mirror_relations=mirror_rel,
                              agreement_mirror=compare(mirror_rel, live_rel))
    return pt


def main(argv: Sequence[str] | None = None) -> dict:
    a = parse_args(argv)
    names = [x for x in a.configs.split(",") if x]
    from cpd.engine.weights import make_tiny_llama_dir
    tmp = tempfile.mkdtemp(prefix="cpd-ordering-")
    model_dir = str(make_tiny_llama_dir(Path(tmp) / "tiny-llama", seed=0))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    res: dict[str, Any] = {"args": vars(a), "load_1m_at_start": rnd(_load(), 2), "points": []}
    t0 = time.monotonic()
    for q in (float(x) for x in a.points.split(",")):
        res["points"].append(run_point(a, q, names, vocab, model_dir))
    res["wall_s"] = rnd(time.monotonic() - t0, 1)
    res["load_1m_at_end"] = rnd(_load(), 2)
    print(markdown(res))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
