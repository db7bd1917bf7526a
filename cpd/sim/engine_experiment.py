"""Experiment points on the engine-object simulator core (:mod:`cpd.sim.engine_sim`), from the
same experiment files as :mod:`cpd.sim.experiment` (which still runs the older core).

Differences from the older core, by construction (they are the live system's behaviour):
write-through to L3 only from the pre-prefill pool (the live dispatch's rule; a ``pd`` config's
``l3_bytes`` gives its prefill workers L3 *reads* only), L2 promotion and L3 loads are
synchronous inside the engine step, and the router's load snapshot carries ``queued_prefill_s``.
"""
from __future__ import annotations

import time
from typing import Any

from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator
from cpd.sim.experiment import _pct, _r, build_cluster, make_workload


def build_engine_cluster(exp: dict, config: str) -> EngineClusterSpec:
    """The cluster of ``exp``'s configuration ``config`` with engine instances."""
    c = build_cluster(exp, config)
    insts = []
    for s in c.instances:
        l1 = s.l1_blocks if s.l1_blocks is not None else max(1, s.cost.kv_capacity_tokens // c.block_size)
        insts.append(EngineInstanceSpec(s.role, s.cost, s.sched, l1, s.l2_blocks * c.block_size * s.cost.kv_bytes_per_token))
    l3_bytes = c.l3_blocks * c.block_size * c.router_cost.kv_bytes_per_token
    return EngineClusterSpec(tuple(insts), c.routing, c.router_cost, c.block_size, l3_bytes, c.kv_event_delay_s)


def run_engine_point(exp: dict, config: str, qps_per_gpu: float, seed: int | None = None) -> dict[str, Any]:
    """Simulate one (configuration, load) point; TTFT over the steady window, plus the simulator's
    own speed (simulated seconds per wall second)."""
    cluster = build_engine_cluster(exp, config)
    gpus = sum(i.cost.tp for i in cluster.instances)
    total = qps_per_gpu * gpus
    reqs, prewarm = make_workload(exp, total, int(exp.get("seed", 0) if seed is None else seed))
    ramp, steady = exp.get("ramp_s", 30), exp.get("steady_s", 600)
    t0, t1 = float(ramp), float(ramp + steady)
    wall = time.perf_counter()
    sim = EngineSimulator(cluster, reqs, stop_s=t1 + exp.get("drain_s", 60), prewarm=prewarm).run()
    wall = time.perf_counter() - wall
    win = [r for r in sim.rec if r is not None and t0 <= r["arrival"] < t1]
    ttft = [r["ttft_t"] - r["arrival"] for r in win if r["ttft_t"] is not None]
    return {"config": config, "qps_per_gpu": qps_per_gpu, "num_gpus": gpus, "requests": len(win),
            "completion_ratio": _r(len(ttft) / max(1, len(win))),
            "ttft_s": {"p50": _r(_pct(ttft, 0.5)), "p90": _r(_pct(ttft, 0.9))},
            "busy_s": {k: _r(v) for k, v in sim.busy_s().items()}, "simulated_s": _r(sim.now),
            "wall_s": _r(wall, 3), "sim_s_per_wall_s": _r(sim.now / max(wall, 1e-9), 3), "events": sim.events_run}
