"""The router's view of its workers: addresses, health and load figures.

Load figures the policy reads are kept by the router itself (exact and fresh):
queued prefill tokens and running requests are incremented at dispatch and
decremented when the work returns. KV pool use and health come from polling
each worker's ``GET /load``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx
import msgspec

from cpd.messages.worker_api import LoadReport, decode_body
from cpd.policy.prefill_queue import QueuedPrefills
from cpd.policy.routing import DispatchRates, WorkerLoad
from cpd.types import PREFILL_SIDE_ROLES, Role

log = logging.getLogger("cpd.router")


@dataclass
class WorkerInfo:
    """One worker as the router knows it.

    Attributes:
        worker_id, role: identity (role ∈ pre-prefill | prefill | decode).
        url: base URL of its internal HTTP API.
        events_endpoint: ZMQ endpoint of its KV-event publisher.
        queued_prefill_tokens: prompt tokens dispatched and not yet prefilled.
        queued: the policy's estimates for those requests (:class:`cpd.policy.prefill_queue.QueuedPrefills`;
            ``queued_prefill_s``: their sum now, with ``router.queue_remaining`` a started one's remaining part).
        running_requests: requests dispatched and not finished on this worker.
        pending_handoffs: decode workers: requests routed here whose prefill is still running on a
            prefill-side worker (routing rule 6 counts them with the running ones).
        kv_usage: last polled L1 use in [0, 1].
        healthy: False after a failed poll or request, True again after a good poll.
        state: ``unchecked`` | ``accepted`` | ``refused`` — the compatibility verdict
            (:mod:`cpd.router.compat`); only an accepted, healthy worker is routed to.
        refusal_reason: why it is refused (``None`` otherwise).
        boot_id, max_model_len, cost_prior: as its ``GET /info`` last reported them
            (``cost_prior``: :class:`cpd.messages.worker_api.CostPrior` as JSON values, or None).
        last_role_change: the last role change the router saw (``{"from_role", "to_role",
            "reason", "at_unix_s"}``), None if none.
        role_epoch: bumped by every role change; a ``/load`` answer to a poll sent before the
            last change may predate it and never changes the role back.
        rates: short (``warm``) and heavy (``cold``) requests dispatched here, by their dispatch
            time on ``time.monotonic()`` with their own-work estimates (the snapshot's
            ``short_*`` and ``heavy_*`` rates, routing rule A3).
    """

    worker_id: str
    role: str
    url: str
    events_endpoint: str
    queued_prefill_tokens: int = 0
    queued: QueuedPrefills = field(default_factory=QueuedPrefills)
    running_requests: int = 0
    pending_handoffs: int = 0
    kv_usage: float = 0.0
    healthy: bool = True
    last_load: dict = field(default_factory=dict)
    state: str = "unchecked"
    refusal_reason: str | None = None
    boot_id: str | None = None
    max_model_len: int | None = None
    cost_prior: dict | None = None
    last_role_change: dict | None = None
    role_epoch: int = 0
    rates: DispatchRates = field(default_factory=DispatchRates)

    @property
    def queued_prefill_s(self) -> float:
        """Predicted prefill work queued here now (seconds)."""
        return self.queued.queued_s(time.monotonic())

    @property
    def usable(self) -> bool:
        """Healthy and accepted: the policy may route to it."""
        return self.healthy and self.state == "accepted"

    def snapshot(self) -> WorkerLoad:
        now = time.monotonic()
        return WorkerLoad(self.worker_id, Role(self.role), self.queued_prefill_tokens, self.running_requests,
                          self.kv_usage, self.usable, queued_prefill_s=self.queued_prefill_s,
                          pending_handoffs=max(0, self.pending_handoffs), **self.rates.load_fields(now))


def _adopts_role(w: WorkerInfo, reported: Role) -> bool:
    """Whether the router takes the role a worker reports as its own: only for an accepted worker
    and only between the prefill-side roles (what ``POST /role`` on a worker can change). A role
    that contradicts the router's config otherwise stays a refusal (:mod:`cpd.router.compat`)."""
    return (w.state == "accepted" and str(reported) != w.role and reported in PREFILL_SIDE_ROLES
            and Role(w.role) in PREFILL_SIDE_ROLES)


class WorkerSet:
    """All workers, with a background poller of ``/load``. A worker is marked unhealthy after
    ``max_poll_failures`` consecutive failed polls, at once when a request to it fails, and at
    once when its ``/load`` reports itself unhealthy (its engine steps keep failing); a good
    poll that reports it healthy makes it routable again."""

    def __init__(self, workers: list[WorkerInfo], poll_interval_s: float = 0.5, poll_timeout_s: float = 5.0,
                 max_poll_failures: int = 3):
        self.by_id = {w.worker_id: w for w in workers}
        self.poll_interval_s = poll_interval_s
        self.poll_timeout_s = poll_timeout_s
        self.max_poll_failures = max_poll_failures  # consecutive failed polls before "unhealthy"
        self._poll_failures: dict[str, int] = {}
        self._task: asyncio.Task | None = None
        self.on_unhealthy: Callable[[str], None] | None = None  # callback(worker_id)
        self.on_recovered: Callable[[str], None] | None = None  # callback(worker_id)
        # compatibility check (cpd.router.compat) and whether to run it after this poll
        self.admit: Callable[[WorkerInfo], Awaitable[bool]] | None = None
        self.needs_check: Callable[[WorkerInfo, bool], bool] | None = None
        self.on_role_change: Callable[[dict], None] | None = None  # callback(change record)

    def snapshots(self) -> list[WorkerLoad]:
        return [w.snapshot() for w in self.by_id.values()]

    def set_role(self, worker_id: str, role: Role | str, reason: str) -> dict | None:
        """Record that ``worker_id`` now serves ``role`` (the worker already changed it): the
        policy routes by the new role from the next decision on. Returns the change record
        (None if it already had that role); ``on_role_change`` is called with it."""
        w = self.by_id[worker_id]
        if w.role == str(role):
            return None
        change = {"from_role": w.role, "to_role": str(role), "reason": reason, "at_unix_s": time.time()}
        w.role = str(role)
        w.role_epoch += 1
        w.last_role_change = change
        log.warning("worker %s role %s -> %s (%s)", worker_id, change["from_role"], change["to_role"], reason)
        if self.on_role_change is not None:
            self.on_role_change(change)
        return change

    def role_counts(self) -> dict[str, int]:
        """Usable workers per role."""
        out = {str(r): 0 for r in Role}
        for w in self.by_id.values():
            if w.usable:
                out[w.role] = out.get(w.role, 0) + 1
        return out

    def mark_unhealthy(self, worker_id: str) -> None:
        w = self.by_id[worker_id]
        if w.healthy and self.on_unhealthy is not None:
            self.on_unhealthy(worker_id)
        w.healthy = False

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        async def one(w: WorkerInfo):
            epoch = w.role_epoch  # a role change while this poll is in flight wins over its answer
            try:
                r = await client.get(f"{w.url}/load", timeout=self.poll_timeout_s)
                r.raise_for_status()
                load = decode_body(r.content, LoadReport)  # MalformedBody (a ValueError): a failed poll
                w.last_load = msgspec.to_builtins(load)
                self._poll_failures[w.worker_id] = 0
                w.kv_usage = load.kv_usage
                if w.role_epoch == epoch and _adopts_role(w, load.role):  # changed at the worker: its word wins
                    self.set_role(w.worker_id, load.role, "reported by the worker")
                if not load.health.healthy:  # answers, but its engine steps keep failing
                    self.mark_unhealthy(w.worker_id)
                    return
                was_healthy = w.healthy
                check = self.admit is not None and self.needs_check is not None and self.needs_check(w, was_healthy)
                if check and w.state == "accepted":
                    w.state = "unchecked"  # no request until the verdict: it may be another process now
                if not w.healthy and self.on_recovered is not None:
                    self.on_recovered(w.worker_id)
                w.healthy = True
                if check and self.admit is not None:  # (check implies it; said again for the type checker)
                    await self.admit(w)
            except (httpx.HTTPError, ValueError):
                n = self._poll_failures[w.worker_id] = self._poll_failures.get(w.worker_id, 0) + 1
                if n >= self.max_poll_failures:
                    self.mark_unhealthy(w.worker_id)
        await asyncio.gather(*(one(w) for w in self.by_id.values()))

    async def run_poller(self, client: httpx.AsyncClient,
                         tick: Callable[[], Awaitable[None]] | None = None) -> None:
        """Poll every ``poll_interval_s`` until cancelled; ``tick()`` (a liveness tick,
        :mod:`cpd.router.background`) is awaited before each poll."""
        while True:
            if tick is not None:
                await tick()
            await self.poll_once(client)
            await asyncio.sleep(self.poll_interval_s)
