"""Elastic roles planner (issue 11 §3): pure, no I/O, no clock.

It moves prefill-side workers between the pre-prefill and the prefill role at run time, so that
each pool's size follows the work that is homed there by the adaptive routing rule (heavy /
``cold`` work → pre-prefill, short / ``warm`` work → prefill; :mod:`cpd.policy.routing` A2).
The mechanism (live router, simulator) calls :func:`plan_roles` every ``interval_s`` with a
:class:`RoleObservation` (built by :class:`cpd.policy.role_window.RoleWindow`) and applies the
changes it returns.

Rule, per call (at most one change; every change carries a human-readable reason):

1. Demand per pool = the policy's estimated work of the class homed there, per second
   (``cold_work_s_per_s`` → pre-prefill, ``warm_work_s_per_s`` → prefill). A pool's load per
   worker ``u = demand / workers`` (healthy workers of that role; infinite for an empty pool with
   demand). Only the class rates matter, not where spill-over put the work, so the planner sizes
   the pools such that spilling is rarely needed, and its target is the cold/warm work ratio.
2. Minimums first: a pool below its minimum (``min_pre_prefill`` / ``min_prefill``) gets a worker
   from the other pool if that one stays at or above its own minimum.
3. Otherwise a worker moves from pool S to pool D only if all hold:
   a. the move lowers the larger per-worker load ``max(u_S, u_D)`` by more than
      ``min(hysteresis, 0.5 / (n_D + 1))`` (relative; :func:`required_gain`: one more worker in a
      pool of ``n_D`` lowers its load by ``1 / (n_D + 1)`` at most, so a large pool still grows),
      computed with the counts after the move. Every move strictly lowers that maximum and the
      reverse move would raise it, so a steady load never moves a worker back and forth;
   b. D is busy: ``u_D >= BUSY_UTILIZATION`` or its measured TTFT SLO attainment is below
      ``ATTAINMENT_TARGET`` (moving a worker to an idle pool buys nothing, and costs the moved
      worker its warm L1 prefixes);
   c. the measurements do not contradict the rates: S is not measurably worse off than D
      (both lower SLO attainment and a longer p90 queue wait);
   d. S keeps its minimum, and the moved worker has held its role at least ``min_dwell_s``.
4. The worker that moves is the eligible one of S with the least queued work (then fewest running
   requests, then id), so the change disturbs as little queued work as possible.

The planner holds no hidden state: :class:`PlannerState` (time of each worker's last change) goes
in and out explicitly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from cpd.policy.routing import WorkerLoad
from cpd.types import Role

BUSY_UTILIZATION = 0.5
"""Rule 3b: a pool whose per-worker work rate is below this (seconds of work per second) is not
short of workers, whatever the ratio says."""

ATTAINMENT_TARGET = 0.9
"""Rule 3b: a pool whose measured TTFT SLO attainment is below this is short of workers."""


@dataclass(frozen=True)
class PlannerConfig:
    interval_s: float = 5.0       # how often the mechanism calls plan_roles
    min_dwell_s: float = 30.0     # a worker keeps a role at least this long after a change
    hysteresis: float = 0.2       # relative imbalance needed before moving a worker
    min_pre_prefill: int = 1
    min_prefill: int = 1

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.min_dwell_s < 0 or not 0 <= self.hysteresis < 1:
            raise ValueError("planner: interval_s > 0, min_dwell_s >= 0 and 0 <= hysteresis < 1 are required")
        if self.min_pre_prefill < 0 or self.min_prefill < 0:
            raise ValueError("planner: pool minimums must be >= 0")

    def minimum(self, role: Role) -> int:
        return self.min_pre_prefill if role == Role.PRE_PREFILL else self.min_prefill


@dataclass(frozen=True)
class PoolWindow:
    """One prefill-side pool, measured over the last window."""

    role: Role
    num_workers: int
    work_s_per_s: float           # prefill work dispatched to this pool (policy estimates, s) per second
    wait_s_p90: float             # p90 queue wait of prefills that started in the window
    ttft_slo_attainment: float    # fraction of prefills finished within ttft_slo_s (1.0 if none)


@dataclass(frozen=True)
class RoleObservation:
    now_s: float
    pools: Mapping[Role, PoolWindow]
    workers: Sequence[WorkerLoad]  # current roles
    cold_work_s_per_s: float       # work of requests the policy classed cold (any pool), per second
    warm_work_s_per_s: float


@dataclass(frozen=True)
class PlannerState:
    last_change_s: Mapping[str, float] = field(default_factory=dict)  # worker id -> time of its last change


@dataclass(frozen=True)
class RoleChange:
    worker_id: str
    from_role: Role
    to_role: Role
    reason: str


_POOLS = (Role.PRE_PREFILL, Role.PREFILL)


def _other(role: Role) -> Role:
    return Role.PREFILL if role == Role.PRE_PREFILL else Role.PRE_PREFILL


def _load_per_worker(demand_s_per_s: float, num_workers: int) -> float:
    if num_workers > 0:
        return demand_s_per_s / num_workers
    return math.inf if demand_s_per_s > 0 else 0.0


def _pool(obs: RoleObservation, role: Role) -> PoolWindow:
    """The measured window of ``role`` (an unmeasured pool: no wait, SLO met)."""
    return obs.pools.get(role) or PoolWindow(role, 0, 0.0, 0.0, 1.0)


def _movable(obs: RoleObservation, state: PlannerState, cfg: PlannerConfig, role: Role) -> list[WorkerLoad]:
    """Healthy workers of ``role`` past their dwell time, least queued work first (rule 4)."""
    ok = [w for w in obs.workers if w.healthy and w.role == role
          and obs.now_s - state.last_change_s.get(w.worker_id, -math.inf) >= cfg.min_dwell_s]
    return sorted(ok, key=lambda w: (w.queued_prefill_s if w.queued_prefill_s is not None else w.queued_prefill_tokens,
                                     w.running_requests, w.worker_id))


def _describe(obs: RoleObservation, counts: Mapping[Role, int], demand: Mapping[Role, float], dst: Role) -> str:
    """Measured context appended to every reason."""
    p = _pool(obs, dst)
    total = demand[Role.PRE_PREFILL] + demand[Role.PREFILL]
    share = demand[Role.PRE_PREFILL] / total if total > 0 else 0.0
    return (f"cold work {demand[Role.PRE_PREFILL]:.2f} s/s on {counts[Role.PRE_PREFILL]} pre-prefill, "
            f"warm work {demand[Role.PREFILL]:.2f} s/s on {counts[Role.PREFILL]} prefill "
            f"(cold share {share:.0%}); "
            f"{dst} p90 wait {p.wait_s_p90:.2f} s, TTFT SLO attainment {p.ttft_slo_attainment:.2f}")


def required_gain(cfg: PlannerConfig, num_dst_workers: int) -> float:
    """Rule 3a's threshold: the relative drop of the larger per-worker load a move into a pool of
    ``num_dst_workers`` must exceed: ``hysteresis``, capped at half of what one more worker can
    gain there at most (``1 / (num_dst_workers + 1)``), so that a large pool still grows one worker
    at a time toward its target (a flat 20 % stopped a pool at 4 workers, whose 5th worker can
    lower its load by 20 % at most)."""
    return min(cfg.hysteresis, 0.5 / (num_dst_workers + 1))


def _balance_reason(src: Role, dst: Role, counts: Mapping[Role, int], demand: Mapping[Role, float],
                    obs: RoleObservation, cfg: PlannerConfig) -> str | None:
    """Rules 3a-3c for moving one worker ``src`` → ``dst``: the reason, or None if the move is not due."""
    u_src, u_dst = (_load_per_worker(demand[r], counts[r]) for r in (src, dst))
    before = max(u_src, u_dst)
    after = max(_load_per_worker(demand[src], counts[src] - 1), _load_per_worker(demand[dst], counts[dst] + 1))
    if not after < (1.0 - required_gain(cfg, counts[dst])) * before:
        return None
    p_src, p_dst = _pool(obs, src), _pool(obs, dst)
    if u_dst < BUSY_UTILIZATION and p_dst.ttft_slo_attainment >= ATTAINMENT_TARGET:
        return None
    if p_src.ttft_slo_attainment < p_dst.ttft_slo_attainment and p_src.wait_s_p90 > p_dst.wait_s_p90:
        return None
    return f"balance: load per worker {before:.2f} -> {after:.2f} s/s"


def _minimum_reason(src: Role, dst: Role, counts: Mapping[Role, int], cfg: PlannerConfig) -> str | None:
    """Rule 2: ``dst`` is below its minimum."""
    if counts[dst] < cfg.minimum(dst):
        return f"minimum: {dst} has {counts[dst]} < {cfg.minimum(dst)} workers"
    return None


def plan_roles(obs: RoleObservation, state: PlannerState, cfg: PlannerConfig
               ) -> tuple[tuple[RoleChange, ...], PlannerState]:
    """Role changes to make now (at most one), and the planner's next state (module docstring)."""
    counts = {r: sum(1 for w in obs.workers if w.healthy and w.role == r) for r in _POOLS}
    demand = {Role.PRE_PREFILL: max(0.0, obs.cold_work_s_per_s), Role.PREFILL: max(0.0, obs.warm_work_s_per_s)}
    for rule in ("minimum", "balance"):
        for dst in _POOLS:
            src = _other(dst)
            if counts[src] - 1 < cfg.minimum(src):
                continue
            why = (_minimum_reason(src, dst, counts, cfg) if rule == "minimum"
                   else _balance_reason(src, dst, counts, demand, obs, cfg))
            movable = _movable(obs, state, cfg, src) if why else []
            if movable:
                w = movable[0]
                reason = f"{why} ({_describe(obs, counts, demand, dst)})"
                nxt = PlannerState({**state.last_change_s, w.worker_id: obs.now_s})
                return (RoleChange(w.worker_id, src, dst, reason),), nxt
    return (), state
