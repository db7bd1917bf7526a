"""Elastic roles planner (issue 11 §3): pure, no I/O, no clock.

NOTE TO THE POLICY HELPER (from the lead): the interface below is fixed (the live router and the
simulator code against it); implement ``plan_roles`` and extend freely without renaming. Ground
rules for every helper: /work/notes/common.md; the shared interface: /work/notes/planner_iface.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from cpd.policy.routing import WorkerLoad
from cpd.types import Role


@dataclass(frozen=True)
class PlannerConfig:
    interval_s: float = 5.0       # how often the mechanism calls plan_roles
    min_dwell_s: float = 30.0     # a worker keeps a role at least this long after a change
    hysteresis: float = 0.2       # relative imbalance needed before moving a worker
    min_pre_prefill: int = 1
    min_prefill: int = 1


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


def plan_roles(obs: RoleObservation, state: PlannerState, cfg: PlannerConfig
               ) -> tuple[tuple[RoleChange, ...], PlannerState]:
    """Role changes to make now (at most one), and the planner's next state."""
    raise NotImplementedError("the policy helper implements this (issue 11 §3)")
