"""Assemble the router: OpenAI front + CPD backend + prefix index + metrics.

The KV namespace and context limit come from the router config (:mod:`cpd.deploy` writes
what the workers reported). Each worker is checked against them when the router first
reaches it and again after it was unhealthy or restarted (:mod:`cpd.router.compat`): a
worker with another namespace or a smaller context is refused, never routed to, and shown
as refused in ``/cpd/workers``, ``/health`` and the log, so router and usable workers
always hash blocks identically and hold every admitted request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import replace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cpd.auth import client_auth
from cpd.kv.block_hash import Namespace
from cpd.kv.event_bus import EventSubscriber
from cpd.kv.events import decode_batch_for_index
from cpd.messages.worker_api import KvSnapshot, L3Snapshot, MalformedBody, decode_body
from cpd.policy.roles import PlannerConfig
from cpd.policy.routing import LinearCostModel, RoutingConfig
from cpd.router import compat, registration
from cpd.router.background import (BACKGROUND_STALLED, ELASTIC, KV_EVENTS, MAINTENANCE, WORKER_POLLER,
                                   BackgroundTasks, stall_bound_s)
from cpd.router.api_keys import DEFAULT_OPEN_PATHS, ApiKeyMiddleware, ApiKeys, TenantScopedBackend, current_tenant
from cpd.router.dispatch import CPDBackend, DispatchTimeouts
from cpd.router.dispatch_records import publish_cost_model
from cpd.router.elastic import ElasticRoles, RoleAssignment, apply_role_change
from cpd.router.errors import error_response
from cpd.router.estimates import CostEstimates
from cpd.router.index import PrefixIndex
from cpd.router.index_query import IndexMatchQuery, match_prompt
from cpd.router.metrics import RouterMetrics
from cpd.router.openai_api import create_app
from cpd.router.request_body import DEFAULT_MAX_REQUEST_BODY_BYTES, read_limited
from cpd.router.workers import WorkerInfo, WorkerSet
from cpd.types import Topology

log = logging.getLogger("cpd.router")
L3_RESYNC_RETRY_S = 2.0  # pause between failed L3 view rebuilds


class Router:
    """Holds the router's state; :meth:`app` builds the FastAPI application."""

    def __init__(self, workers: list[WorkerInfo], namespace: Namespace, tokenizer_dir: str, model_name: str,
                 max_model_len: int, kv_bytes_per_token: int, topology: str = "cpd", cold_threshold: float = 0.5,
                 routing: RoutingConfig | None = None, elastic: PlannerConfig | None = None,
                 role_window_s: float = 30.0, raw_ready_margin_s: float = 0.25, max_in_flight: int = 256, max_decode_per_worker: int = 64,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, api_keys: ApiKeys | None = None,
                 open_paths: tuple[str, ...] = DEFAULT_OPEN_PATHS, internal_secret: bytes | None = None,
                 timeouts: DispatchTimeouts | None = None, prefill_cost_fit: bool = False,
                 background_stall_timeout_s: float = 60.0, queue_remaining: bool = False):
        self.timeouts = timeouts  # router->worker call bounds; None = defaults / CPD_DISPATCH_TIMEOUTS
        self.api_keys = api_keys or ApiKeys({})  # client keys -> tenants (cpd.router.api_keys)
        self.open_paths = tuple(open_paths)
        self.internal_secret = internal_secret  # signs calls to workers (cpd.auth)
        self.workers = WorkerSet(workers)
        self.index = PrefixIndex()
        self.metrics = RouterMetrics()
        # background tasks: ticks, in-process restarts, and the /health verdict (cpd.router.background)
        self.background = BackgroundTasks()
        self.background_stall_timeout_s = background_stall_timeout_s
        self.metrics.watch_background(self.background)
        # routing settings: ``routing`` (cpd.config.routing_config), else the static defaults; the
        # block size is always the served namespace's
        base = routing or RoutingConfig(topology=Topology(topology), cold_threshold=cold_threshold)
        self.cfg = replace(base, block_size=namespace.block_size)
        self.planner_cfg = elastic  # None: roles stay as configured (router.elastic off)
        self.role_window_s = role_window_s
        self.raw_ready_margin_s = raw_ready_margin_s
        self.queue_remaining = queue_remaining  # router.queue_remaining (cpd.policy.prefill_queue)
        self.elastic: ElasticRoles | None = None
        self.estimates = CostEstimates(LinearCostModel(kv_bytes_per_token=kv_bytes_per_token),
                                       fit_prefill=prefill_cost_fit)
        publish_cost_model(self.metrics, self.estimates.model())  # the workers' cost priors replace it at admission
        self.namespace = namespace
        self.tokenizer_dir = tokenizer_dir
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_in_flight = max_in_flight
        self.max_decode_per_worker = max_decode_per_worker
        self.max_request_body_bytes = max_request_body_bytes
        self.subscriber: EventSubscriber | None = None
        self.client: httpx.AsyncClient | None = None  # created in the app's lifespan (needs its event loop)
        self.backend: CPDBackend | None = None
        self._resync_pending: set[str] = set()
        self._l3_resync_pending = True  # rebuild the L3 view from a store listing (start, gaps)
        self._l3_resync_after = 0.0  # monotonic time before which no retry is made
        self.workers.on_unhealthy = self._on_unhealthy
        self.workers.on_recovered = self._resync_pending.add  # rebuild its index entries
        self.requirements = compat.Requirements(namespace, max_model_len)
        self.workers.admit = self._admit
        self.workers.needs_check = compat.needs_check

    async def _admit(self, w: WorkerInfo) -> bool:
        """Check one worker's namespace and capacity (:mod:`cpd.router.compat`); a refused one
        loses its index entries and is never routed to. A worker that restarted (new ``boot_id``,
        e.g. restarted by ``cpd serve`` between two polls) has an empty cache and an event
        sequence that starts over: its entries are dropped and rebuilt from its snapshot."""
        old_boot_id = w.boot_id
        ok = await compat.admit(self._http(), w, self.requirements, on_role_swap=self._adopt_reported_role)
        restarted = old_boot_id is not None and w.boot_id != old_boot_id
        if not ok or restarted:
            self.index.drop_worker(w.worker_id)
        self._adopt_cost_prior(w, ok)
        if ok and restarted:
            log.warning("worker %s restarted (boot id %s -> %s): rebuilding its index entries", w.worker_id,
                        old_boot_id, w.boot_id)
            self._resync_pending.add(w.worker_id)
        return ok

    def _adopt_cost_prior(self, w: WorkerInfo, accepted: bool) -> None:
        """An accepted worker's advertised costs (``cost_prior`` of its ``/info``) price what the
        router has not measured yet (:meth:`CostEstimates.advertise`); a worker not accepted
        withdraws its say."""
        est = self.estimates
        before = est.model()
        if accepted:
            est.advertise(w.worker_id, w.cost_prior)
        else:
            est.forget(w.worker_id)
        after = est.model()
        publish_cost_model(self.metrics, after)
        if after != before:
            log.info("cost prior from the workers (%s): prefill %.0f tok/s, L2 %.3g B/s, L3 %.3g B/s "
                     "(measured so far: %s)", (w.cost_prior or {}).get("source") or w.worker_id,
                     after.prefill_tokens_per_s, after.l2_bytes_per_s, after.l3_bytes_per_s,
                     ", ".join(sorted(est.measured)) or "nothing")

    def _adopt_reported_role(self, w: WorkerInfo, role: str) -> None:
        """A worker checked at admission serves the other prefill-side role than the router's
        view (changed at run time, then the router or the worker restarted): its word wins."""
        self.workers.set_role(w.worker_id, role, "reported by the worker at admission")

    def _on_unhealthy(self, worker_id: str) -> None:
        """A worker stopped answering: forget its L1/L2 blocks and count it."""
        self.index.drop_worker(worker_id)
        self.metrics.fallbacks.labels("worker_unhealthy").inc()

    def _on_batch(self, worker_id: str, seq: int, batch) -> None:
        if not self.index.apply_batch(worker_id, seq, batch):
            self._resync_pending.add(worker_id)
            self._l3_resync_pending = True  # its lost batches may have held L3 events

    def _http(self) -> httpx.AsyncClient:
        """The HTTP client to the workers (exists while the app runs)."""
        if self.client is None:
            raise RuntimeError("the router's HTTP client exists only while its app runs")
        return self.client

    async def resync(self, worker_id: str) -> None:
        """Rebuild one worker's L1/L2 index entries from its snapshot."""
        w = self.workers.by_id[worker_id]
        try:
            r = await self._http().get(f"{w.url}/kv_snapshot", timeout=5.0)
            r.raise_for_status()
            snap = decode_body(r.content, KvSnapshot)  # MalformedBody is a ValueError
            self.index.replace_worker(worker_id, snap.l1, snap.l2, seq=snap.seq)
        except (httpx.HTTPError, ValueError) as e:
            log.warning("resync of %s failed: %r", worker_id, e)

    async def resync_l3(self) -> None:
        """Rebuild the L3 view from a store listing that a prefill-side worker takes
        (``GET /l3_snapshot``); L3 events arriving meanwhile are journaled and replayed on top.
        Done once one worker answers, or when none has a store; retried by the maintenance
        loop otherwise (issue 7 §6: a restarted router relearns L3)."""
        self._l3_resync_pending = False
        for w in self.workers.by_id.values():
            if w.role == "decode" or not getattr(w, "usable", w.healthy):
                continue
            self.index.begin_l3_resync()
            try:
                r = await self._http().get(f"{w.url}/l3_snapshot", timeout=30.0)
                if r.status_code == 200:
                    self.index.finish_l3_resync(decode_body(r.content, L3Snapshot).chunks)
                    return
                self.index.abort_l3_resync()
                if r.status_code == 404:  # no store on this worker
                    continue
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                self.index.abort_l3_resync()
                log.warning("L3 resync via %s failed: %r", w.worker_id, e)
            self._l3_resync_pending = True  # store or worker unreachable: try again later
            return

    def _on_events_restart(self) -> None:
        """The KV-event subscriber restarts after it died: events were lost meanwhile, so every
        worker's L1/L2 entries and the L3 view are rebuilt from snapshots (as after a gap)."""
        self._resync_pending.update(self.workers.by_id)
        self._l3_resync_pending = True

    async def _maintenance(self) -> None:
        tick = self.background.atick
        while True:
            await tick(MAINTENANCE)
            if self._l3_resync_pending and time.monotonic() >= self._l3_resync_after:
                self._l3_resync_after = time.monotonic() + L3_RESYNC_RETRY_S
                await self.resync_l3()
                await tick(MAINTENANCE)  # each call is bounded; a tick between them bounds the silence
            for wid in list(self._resync_pending):
                self._resync_pending.discard(wid)
                await self.resync(wid)
                await tick(MAINTENANCE)
            for tier, n in self.index.sizes().items():
                self.metrics.index_blocks.labels(tier).set(n)
            await asyncio.sleep(0.2)

    def app(self) -> FastAPI:
        router = self

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            # Idle connections expire here (2 s) well before the workers close them (30 s), so a
            # request never races a server-side keep-alive close.
            router.client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                                                                  keepalive_expiry=2.0),
                                              auth=client_auth(router.internal_secret))
            backend.client = router.client
            bg = router.background
            stall_s = router.background_stall_timeout_s
            bg.register(KV_EVENTS, stall_bound_s(stall_s, 0.05))
            router.subscriber = EventSubscriber(
                router._on_batch, on_iteration=lambda: bg.tick(KV_EVENTS),
                runner=lambda body, stop: bg.run_thread(KV_EVENTS, body, stop, on_restart=router._on_events_restart),
                decode=decode_batch_for_index)
            for w in router.workers.by_id.values():
                router.subscriber.add(w.worker_id, w.events_endpoint)
            await asyncio.gather(*(router._admit(w) for w in router.workers.by_id.values()))
            await asyncio.sleep(0.2)  # let SUB sockets connect before the snapshot
            await asyncio.gather(*(router.resync(w) for w in router.workers.by_id))
            await router.resync_l3()
            client = router._http()
            bg.register(WORKER_POLLER, stall_bound_s(stall_s, router.workers.poll_interval_s))
            bg.register(MAINTENANCE, stall_bound_s(stall_s, 0.2))
            tasks = [asyncio.create_task(bg.run_async(
                         WORKER_POLLER, lambda: router.workers.run_poller(client, lambda: bg.atick(WORKER_POLLER)))),
                     asyncio.create_task(bg.run_async(MAINTENANCE, router._maintenance))]
            if router.elastic is not None:
                elastic = router.elastic
                bg.register(ELASTIC, stall_bound_s(stall_s, elastic.cfg.interval_s))
                tasks.append(asyncio.create_task(bg.run_async(
                    ELASTIC, lambda: elastic.run(client, lambda: bg.atick(ELASTIC)))))
            yield
            for t in tasks:
                t.cancel()
            router.subscriber.close()
            await backend.releaser.aclose()
            await router.client.aclose()

        backend = self.backend = CPDBackend(self.workers, self.index, self.namespace, self.cfg, self.estimates,
                                            self.metrics, client=None,  # type: ignore[arg-type]  # set in lifespan
                                            max_in_flight=self.max_in_flight,
                                  max_decode_per_worker=self.max_decode_per_worker, timeouts=self.timeouts,
                                            raw_ready_margin_s=self.raw_ready_margin_s,
                                            queue_remaining=self.queue_remaining)
        if self.planner_cfg is not None:
            from cpd.policy.role_window import RoleWindow
            self.backend.role_window = RoleWindow(self.role_window_s, self.cfg.ttft_slo_s)
            self.elastic = ElasticRoles(self.workers, self.backend.role_window, self.planner_cfg, self.metrics)
        self.metrics.watch_workers(self.workers)
        app = create_app(TenantScopedBackend(self.backend), self.tokenizer_dir, self.model_name, self.max_model_len,
                         max_request_body_bytes=self.max_request_body_bytes)
        app.router.lifespan_context = lifespan

        @app.get("/metrics")
        async def metrics():
            return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

        @app.get("/cpd/workers")
        async def workers():
            return {w.worker_id: _worker_view(w) for w in router.workers.by_id.values()}

        @app.get("/cpd/requests")
        async def recent_requests():
            """Routing records of the last 1000 requests (class, pool, workers, cached tokens per tier);
            with API keys, the caller's tenant's only."""
            return router.backend.recent.visible_to(current_tenant.get())

        @app.get("/cpd/elastic")
        async def elastic():
            """Elastic roles: on or off, planner settings, rounds planned, last planning error."""
            e = router.elastic
            if e is None:
                return {"enabled": False}
            return {"enabled": True, "planner": dataclasses.asdict(e.cfg), "num_plans": e.num_plans,
                    "last_error": e.last_error, "last_change_s": dict(e.state.last_change_s)}

        @app.get("/cpd/index")
        async def index():
            """Blocks per tier in the prefix index, and the pending L3 writes (read-after-write)."""
            return {**router.index.sizes(), "pending_writes": router.index.num_pending_writes()}

        @app.post("/cpd/index/match")
        async def index_match(request: Request):
            """Where the prompt's leading blocks are in the index now (:mod:`cpd.router.index_query`);
            the caller's namespace only."""
            try:
                q = decode_body(await read_limited(request, router.max_request_body_bytes), IndexMatchQuery)
            except MalformedBody as e:
                return error_response(400, f"bad index query: {e}", code="invalid_index_query")
            if len(q.prompt_token_ids) > router.max_model_len:
                return error_response(400, f"the prompt has {len(q.prompt_token_ids)} tokens, more than the "
                                           f"context length {router.max_model_len}", code="context_length_exceeded")
            return match_prompt(router.index, router.namespace, q, current_tenant.get())

        @app.post("/cpd/role", include_in_schema=False)
        async def change_role(request: Request):
            """Force a worker's role (signed like /cpd/register): worker first, then the router."""
            if not router.internal_secret and router.api_keys.enabled:  # clients authenticate, workers do not
                return error_response(403, "POST /cpd/role needs the internal secret (auth.internal_secret_file "
                                           "or $CPD_INTERNAL_SECRET) when client API keys are on",
                                      code="internal_secret_required")
            body = await request.body()
            refused = registration.check_signature(request, body, router.internal_secret, None, "a role change")
            if refused is not None:
                return refused
            try:
                a = decode_body(body, RoleAssignment)
            except MalformedBody as e:
                return error_response(400, f"bad role change: {e}", code="invalid_role_change")
            if a.worker_id not in router.workers.by_id:
                return error_response(404, f"unknown worker {a.worker_id!r}", code="unknown_worker")
            ok, msg = await apply_role_change(router._http(), router.workers, a.worker_id, str(a.role),
                                              "forced via POST /cpd/role")
            if not ok:
                return error_response(409, msg, code="role_change_refused")
            return {"worker_id": a.worker_id, "role": router.workers.by_id[a.worker_id].role, "result": msg}

        _replace_health(app, router)
        registration.install(app, router, router.internal_secret)  # POST /cpd/register (cpd worker --router)
        app.add_middleware(ApiKeyMiddleware, keys=self.api_keys, open_paths=self.open_paths)
        return app


def _worker_view(w: WorkerInfo) -> dict:
    """One worker in ``GET /cpd/workers``: registration, compatibility, the router's load bookkeeping
    and the short- and heavy-work rates routing rule A3 prices moves between pools with (as the policy's snapshot reads them)."""
    now = time.monotonic()
    return {"role": w.role, "url": w.url, "healthy": w.healthy, "state": w.state,
            "reason": w.refusal_reason, "max_model_len": w.max_model_len,
            "queued_prefill_tokens": w.queued_prefill_tokens, "queued_prefill_s": w.queued_prefill_s,
            "running_requests": w.running_requests, "pending_handoffs": w.pending_handoffs,
            **w.rates.load_fields(now),
            "load": w.last_load, "cost_prior": w.cost_prior, "last_role_change": w.last_role_change}


def _replace_health(app: FastAPI, router: Router) -> None:
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/health"]

    @app.get("/health")
    async def health():
        """200 ``ok``: a usable prefill-side and a usable decode worker, and every background task
        alive and progressing. 503 ``degraded``: no usable worker of a side (the router itself is
        fine). 503 ``background_stalled`` (with ``reason``): a background task died or stalled
        (:func:`cpd.router.background.background_verdict`); ``cpd serve`` restarts such a router.
        ``background``: each task's ``alive``, ``last_ok_age_s``, ``restarts``, ``last_error``."""
        ws = router.workers.by_id.values()
        ok = any(w.usable and w.role != "decode" for w in ws) and any(w.usable and w.role == "decode" for w in ws)
        verdict = router.background.verdict()
        body = {"status": "ok" if ok else "degraded",
                "workers": {w.worker_id: w.usable for w in ws},
                "refused": {w.worker_id: w.refusal_reason for w in ws if w.state == compat.REFUSED},
                "background": router.background.report()}
        if not verdict.healthy:
            body.update(status=BACKGROUND_STALLED, reason=verdict.reason, background_stalled=list(verdict.failing))
        return JSONResponse(body, status_code=200 if ok and verdict.healthy else 503)
