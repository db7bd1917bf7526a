"""Elastic roles, the mechanism (issue 11 §3): every ``interval_s`` the router asks the pure
planner (:func:`cpd.policy.roles.plan_roles`) whether a prefill-side worker should change role,
and applies what it answers.

Inputs: a :class:`cpd.policy.role_window.RoleWindow` that the dispatcher feeds
(``observe_dispatch`` at each prefill dispatch, ``observe_prefill_done`` at each answer) and the
workers' current load snapshots. A change is applied worker first (``POST /role``, signed like
every internal call), then in the router's :class:`cpd.router.workers.WorkerSet` (the policy
routes by the new role from the next decision on). A worker that refuses or cannot be reached
keeps its role (logged); the planner sees the unchanged role at its next call. Requests already
on the worker finish unchanged: a role only steers routing, so a change loses no request and
leaks no block.

``POST /cpd/role`` (:class:`RoleAssignment`; signed with the internal secret like
``/cpd/register``) forces a change through the same path (operators, tests); it works with
``router.elastic`` off too. A change the planner did not make (forced, or adopted from the worker
or from a restarted side) starts that worker's minimum dwell too: the planner notes it at its next
round (:meth:`ElasticRoles.plan_once`), so it never moves a worker straight back.

Every change is logged, counted (``cpd_role_changes_total{from_role,to_role}``; workers per role:
``cpd_workers{role}``) and shown in ``/cpd/workers`` (``last_role_change``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import httpx
import msgspec

from cpd.messages.worker_api import (MalformedBody, RoleChangeRequest, RoleChangeResponse, decode_body,
                                     encode)
from cpd.policy.role_window import RoleWindow
from cpd.policy.roles import PlannerConfig, PlannerState, RoleChange, plan_roles
from cpd.router.metrics import RouterMetrics
from cpd.router.workers import WorkerSet
from cpd.types import Role

log = logging.getLogger("cpd.router.elastic")
ROLE_CHANGE_TIMEOUT_S = 5.0


class ElasticRoles:
    """The router's planner loop (one per router; on when ``router.elastic``)."""

    def __init__(self, workers: WorkerSet, window: RoleWindow, cfg: PlannerConfig, metrics: RouterMetrics):
        self.workers = workers
        self.window = window
        self.cfg = cfg
        self.metrics = metrics
        self.state = PlannerState()
        self._epochs = {wid: w.role_epoch for wid, w in workers.by_id.items()}  # role changes seen
        self.num_plans = 0
        self.last_error: str | None = None

    async def run(self, client: httpx.AsyncClient, tick: Callable[[], Awaitable[None]] | None = None) -> None:
        """Plan and apply every ``interval_s`` until cancelled. A planner error is logged and
        the loop goes on (the next window may plan fine). ``tick()`` (a liveness tick,
        :mod:`cpd.router.background`) is awaited before each round."""
        while True:
            if tick is not None:
                await tick()
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.plan_once(client)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the loop must survive a bad window
                if repr(e) != self.last_error:
                    log.error("elastic roles: planning failed: %r", e)
                self.last_error = repr(e)

    async def plan_once(self, client: httpx.AsyncClient, now_s: float | None = None) -> list[RoleChange]:
        """One planning round: observe, plan, apply. Returns the changes applied."""
        now = time.monotonic() if now_s is None else now_s
        self._note_outside_changes(now)
        obs = self.window.observation(now, self.workers.snapshots())
        changes, self.state = plan_roles(obs, self.state, self.cfg)
        self.num_plans += 1
        applied = []
        for c in changes:
            if await self.apply(client, c.worker_id, str(c.to_role), f"planner: {c.reason}"):
                applied.append(c)
        self._epochs = {wid: w.role_epoch for wid, w in self.workers.by_id.items()}  # ours are in the state
        return applied

    def _note_outside_changes(self, now: float) -> None:
        """Workers whose role changed since the last round without the planner (``role_epoch``
        moved): their dwell starts now (at most one interval after the change: conservative)."""
        changed = {wid: now for wid, w in self.workers.by_id.items()
                   if w.role_epoch != self._epochs.get(wid, w.role_epoch)}
        if changed:
            self.state = PlannerState({**self.state.last_change_s, **changed})

    async def apply(self, client: httpx.AsyncClient, worker_id: str, to_role: str, reason: str) -> bool:
        return (await apply_role_change(client, self.workers, worker_id, to_role, reason))[0]


class RoleAssignment(msgspec.Struct, frozen=True):
    """Body of the router's ``POST /cpd/role``: give ``worker_id`` the role ``role``."""

    worker_id: str
    role: Role


async def apply_role_change(client: httpx.AsyncClient, workers: WorkerSet, worker_id: str, to_role: str,
                            reason: str) -> tuple[bool, str]:
    """Change one worker's role: the worker first (``POST /role``), then the router's view.
    Returns (done, what happened); not done (logged) if the worker is unknown, refused, or could
    not be reached."""
    w = workers.by_id.get(worker_id)
    if w is None:
        return False, f"unknown worker {worker_id}"
    try:
        r = await client.post(f"{w.url}/role", content=encode(RoleChangeRequest(Role(to_role))),
                              headers={"content-type": "application/json"}, timeout=ROLE_CHANGE_TIMEOUT_S)
        if r.status_code != 200:
            msg = f"{worker_id} refused {w.role} -> {to_role}: {r.text[:200]}"
            log.warning("role change: %s", msg)  # the caller gets it; a refusal is not a router fault
            return False, msg
        ans = decode_body(r.content, RoleChangeResponse)
    except (httpx.HTTPError, MalformedBody) as e:
        msg = f"changing {worker_id} to {to_role} failed: {e!r}"
        log.error("role change: %s", msg)
        return False, msg
    workers.set_role(worker_id, ans.to_role, reason)
    # the worker's answer says whether it changed: a worker started with --router re-registers
    # with its new role at once, and that registration may reach the router's view first
    return True, "changed" if ans.from_role != ans.to_role else f"already {ans.to_role}"


__all__ = ["ElasticRoles", "RoleAssignment", "apply_role_change"]
