"""The one window tracker of pool measurements that both the live router and the simulator feed
with explicit timestamps (no clock inside); it builds the planner's
:class:`cpd.policy.roles.RoleObservation`.

What it measures over the last ``window_s`` seconds (samples older than that are dropped, so its
memory is bounded by the traffic of one window):

* per dispatch (:meth:`RoleWindow.observe_dispatch`): the policy's work estimate ``est_s``,
  counted for the pool the decision chose (``PoolWindow.work_s_per_s``) and for the class the
  policy gave the request (``cold_work_s_per_s`` / ``warm_work_s_per_s``). Decode-local appends
  (pool ``decode``) need no prefill-side worker and count for neither;
* per finished prefill (:meth:`RoleWindow.observe_prefill_done`): its queue wait and whether its
  TTFT met ``ttft_slo_s`` (``wait_s_p90``, nearest rank; ``ttft_slo_attainment``, 1.0 with none).

Rates divide by ``window_s`` (the first window after start-up reads low; the planner compares
ratios and uses the rates only against ``BUSY_UTILIZATION``). Timestamps are expected in
non-decreasing order (a monotonic clock, or the simulator's event time).
"""
from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple, Sequence

from cpd.policy.roles import PoolWindow, RoleObservation
from cpd.policy.routing import RouteDecision, WorkerLoad
from cpd.types import PREFILL_SIDE_ROLES, RequestClass, Role


class _Dispatch(NamedTuple):
    t_s: float
    pool: Role
    cold: bool
    est_s: float


class _Done(NamedTuple):
    t_s: float
    role: Role
    wait_s: float
    met_slo: bool


def _p90(values: Sequence[float]) -> float:
    """Nearest-rank 90th percentile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


class RoleWindow:
    def __init__(self, window_s: float = 30.0, ttft_slo_s: float = 2.0):
        if window_s <= 0 or ttft_slo_s <= 0:
            raise ValueError("RoleWindow: window_s and ttft_slo_s must be > 0")
        self.window_s = window_s
        self.ttft_slo_s = ttft_slo_s
        self._dispatches: deque[_Dispatch] = deque()
        self._dones: deque[_Done] = deque()

    def observe_dispatch(self, now_s: float, decision: RouteDecision, est_s: float) -> None:
        """One routed request: its chosen pool, its class and the policy's work estimate (s)."""
        self._dispatches.append(_Dispatch(now_s, Role(decision.pool), decision.request_class == RequestClass.COLD,
                                          max(0.0, est_s)))
        self._trim(now_s)

    def observe_prefill_done(self, now_s: float, role: Role, wait_s: float, ttft_s: float) -> None:
        """One finished prefill on a worker of ``role``: its queue wait and TTFT (s)."""
        self._dones.append(_Done(now_s, Role(role), max(0.0, wait_s), ttft_s <= self.ttft_slo_s))
        self._trim(now_s)

    def observation(self, now_s: float, workers: Sequence[WorkerLoad]) -> RoleObservation:
        """The planner's input for the window ending at ``now_s``; ``workers`` are the current roles."""
        self._trim(now_s)
        prefill_side = [d for d in self._dispatches if d.pool in PREFILL_SIDE_ROLES]
        cold = sum(d.est_s for d in prefill_side if d.cold) / self.window_s
        warm = sum(d.est_s for d in prefill_side if not d.cold) / self.window_s
        pools = {r: self._pool(r, workers) for r in PREFILL_SIDE_ROLES}
        return RoleObservation(now_s, pools, tuple(workers), cold, warm)

    def _pool(self, role: Role, workers: Sequence[WorkerLoad]) -> PoolWindow:
        done = [d for d in self._dones if d.role == role]
        attainment = sum(d.met_slo for d in done) / len(done) if done else 1.0
        work = sum(d.est_s for d in self._dispatches if d.pool == role) / self.window_s
        n = sum(1 for w in workers if w.healthy and w.role == role)
        return PoolWindow(role, n, work, _p90([d.wait_s for d in done]), attainment)

    def _trim(self, now_s: float) -> None:
        """Drop samples older than the window (bounded memory)."""
        start = now_s - self.window_s
        for q in (self._dispatches, self._dones):
            while q and q[0].t_s < start:
                q.popleft()

    def __len__(self) -> int:
        """Samples held (dispatches + finished prefills)."""
        return len(self._dispatches) + len(self._dones)
