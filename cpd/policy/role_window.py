"""The one window tracker of pool measurements that both the live router and the simulator feed
with explicit timestamps (no clock inside); it builds the planner's
:class:`cpd.policy.roles.RoleObservation`.

NOTE TO THE POLICY HELPER (from the lead): interface fixed, implement it (bounded memory: drop
samples older than the window). See /work/notes/planner_iface.md and /work/notes/common.md.
"""
from __future__ import annotations

from typing import Sequence

from cpd.policy.roles import RoleObservation
from cpd.policy.routing import RouteDecision, WorkerLoad
from cpd.types import Role


class RoleWindow:
    def __init__(self, window_s: float = 30.0, ttft_slo_s: float = 2.0):
        self.window_s = window_s
        self.ttft_slo_s = ttft_slo_s

    def observe_dispatch(self, now_s: float, decision: RouteDecision, est_s: float) -> None:
        raise NotImplementedError

    def observe_prefill_done(self, now_s: float, role: Role, wait_s: float, ttft_s: float) -> None:
        raise NotImplementedError

    def observation(self, now_s: float, workers: Sequence[WorkerLoad]) -> RoleObservation:
        raise NotImplementedError
