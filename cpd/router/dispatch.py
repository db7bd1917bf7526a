"""The CPD backend of the router: route, prefill, hand off, relay decode tokens.

Per request (DESIGN §3 request flow):

1. Hash the prompt's full blocks (:mod:`cpd.kv.block_hash`, tenant salt applied).
2. Ask the pure policy (:func:`cpd.policy.routing.route`) with the index match and
   load snapshots → pool, prefill-side worker, load plan, decode worker.
3. ``POST /prefill`` on the chosen worker (pre-prefill writes through to L3; prefill
   loads its prefix from L1/L2/L3). It answers with the first token and a handoff
   handle. The first token is yielded at once (TTFT).
4. ``POST /decode`` on the decode worker with the handle; relay its NDJSON stream.

Closing the generator (client disconnect, stop string) cancels the in-flight HTTP
call, which the worker sees as a disconnect and aborts — blocks are freed on every
worker. A prefill-side worker that fails is marked unhealthy and the request is
retried once elsewhere; a decode failure ends the request with a clear error.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import asdict
from typing import AsyncIterator

import httpx

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.policy.routing import NoWorkerError, RouteDecision, RoutingConfig, route
from cpd.router.estimates import CostEstimates
from cpd.router.index import PrefixIndex
from cpd.router.metrics import RouterMetrics
from cpd.router.protocol import BackendError, GenerationChunk, GenerationRequest
from cpd.router.workers import WorkerSet

log = logging.getLogger("cpd.router")


class CPDBackend:
    """Implements ``GenerationBackend`` over HTTP workers."""

    def __init__(self, workers: WorkerSet, index: PrefixIndex, namespace: Namespace, cfg: RoutingConfig,
                 estimates: CostEstimates, metrics: RouterMetrics, client: httpx.AsyncClient,
                 max_in_flight: int = 256, max_decode_per_worker: int = 64):
        self.workers = workers
        self.index = index
        self.namespace = namespace
        self.cfg = cfg
        self.estimates = estimates
        self.metrics = metrics
        self.client = client
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        # Backpressure: at most this many requests handed to one decode worker at once; the rest
        # wait here with their KV staged on the prefill side (bounded arena), so a slow decode
        # pool cannot grow a decode worker's memory without limit.
        self.decode_slots = {wid: asyncio.Semaphore(max_decode_per_worker) for wid in workers.by_id}
        self.recent: OrderedDict[str, dict] = OrderedDict()  # request_id -> routing record (last 1000)

    def decide(self, req: GenerationRequest) -> tuple[RouteDecision, list[int]]:
        hashes = hash_blocks(req.prompt_token_ids, self.namespace.with_salt(req.cache_salt))
        match = self.index.match(hashes, l3_max_blocks=(len(req.prompt_token_ids) - 1) // self.cfg.block_size)
        try:
            d = route(len(req.prompt_token_ids), match, self.workers.snapshots(), self.cfg, self.estimates.model())
        except NoWorkerError as e:
            raise BackendError(str(e), 503, "service_unavailable") from e
        if d.decode_worker is None:
            raise BackendError("no healthy decode worker", 503, "service_unavailable")
        return d, hashes

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self.in_flight >= self.max_in_flight:
            self.metrics.requests.labels("rejected").inc()
            raise BackendError("too many requests in flight", 429, "rate_limit_exceeded", retry_after_s=1)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        outcome = "error"
        try:
            async for chunk in self._generate(req):
                yield chunk
                if chunk.finish_reason is not None:
                    outcome = "ok"
        except GeneratorExit:
            outcome = "cancelled"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        t0 = req.arrival_time if req.arrival_time is not None else time.monotonic()
        d, hashes = self.decide(req)
        pre = await self._prefill_with_retry(req, d, hashes)
        d, hashes = pre["decision"], pre["hashes"]
        ttft = time.monotonic() - t0
        self._record_prefill(d, pre, ttft, len(req.prompt_token_ids))
        self._correct_stale_index(d, pre, hashes)
        cached = sum(pre["num_cached_tokens_by_tier"].values())
        self._remember(req, d, pre, ttft)
        try:
            yield GenerationChunk(token_ids=pre["first_token_ids"], finish_reason=pre["finish_reason"],
                                  num_cached_tokens=min(cached, len(req.prompt_token_ids)))
        except GeneratorExit:  # gone before decode started: free the staged handoff now
            self._release_handoff(pre)
            raise
        if pre["finish_reason"] is not None:
            return
        n_out = len(pre["first_token_ids"])
        t_first = time.monotonic()
        async for chunk in self._decode(req, d, pre):
            n_out += len(chunk.token_ids)
            yield chunk
        if n_out > 1:
            self.metrics.tpot_s.observe((time.monotonic() - t_first) / (n_out - 1))

    def _release_handoff(self, pre: dict) -> None:
        """Fire-and-forget release of a handoff nobody will fetch (the sender also reclaims
        unreleased regions after a timeout)."""
        handle = pre.get("handoff")
        if not handle:
            return

        async def release():
            try:
                await self.client.post(handle["release_url"], json={"request_id": handle.get("request_id")},
                                       timeout=5.0)
            except httpx.HTTPError:
                pass
        asyncio.get_running_loop().create_task(release())

    async def _prefill_with_retry(self, req: GenerationRequest, d: RouteDecision, hashes: list[int]) -> dict:
        for attempt in range(2):
            try:
                pre = await self._prefill(req, d)
                pre["decision"], pre["hashes"] = d, hashes
                return pre
            except httpx.TransportError as e:
                log.warning("prefill on %s failed (%r); attempt %d", d.prefill_worker, e, attempt)
                self.metrics.fallbacks.labels("prefill_worker_failed").inc()
                if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self.workers.mark_unhealthy(d.prefill_worker)  # nothing listens: route around it
                d, hashes = self.decide(req)
        raise BackendError("prefill failed on two workers", 503, "service_unavailable")

    async def _prefill(self, req: GenerationRequest, d: RouteDecision) -> dict:
        w = self.workers.by_id[d.prefill_worker]
        n = len(req.prompt_token_ids)
        recompute_l3 = any(r.startswith("recompute-L3") for r in d.reasons)
        body = {"request_id": req.request_id, "prompt_token_ids": req.prompt_token_ids,
                "sampling": _sampling_dict(req), "cache_salt": req.cache_salt,
                "max_l3_blocks": d.load_plan.l3_blocks if recompute_l3 else None,
                "write_through": d.pool == "pre-prefill"}
        log.debug("route %s cls=%s pool=%s worker=%s plan=%s reasons=%s", req.request_id, d.request_class, d.pool,
                  d.prefill_worker, asdict(d.load_plan), d.reasons)
        cached = d.load_plan.num_cached_blocks * self.cfg.block_size
        est_s = self.estimates.model().prefill_time_s(n - cached, cached)
        w.queued_prefill_tokens += n
        w.queued_prefill_s += est_s
        w.running_requests += 1
        try:
            r = await self.client.post(f"{w.url}/prefill", json=body, timeout=None)
        finally:
            w.queued_prefill_tokens -= n
            w.queued_prefill_s -= est_s
            w.running_requests -= 1
        if r.status_code != 200:
            raise BackendError(f"prefill worker {w.worker_id} error: {r.text[:200]}", 502, "server_error")
        return r.json()

    async def _decode(self, req: GenerationRequest, d: RouteDecision, pre: dict) -> AsyncIterator[GenerationChunk]:
        w = self.workers.by_id[d.decode_worker]
        body = {"request_id": req.request_id, "token_ids": pre["token_ids"], "sampling": _sampling_dict(req),
                "handoff": pre["handoff"], "num_generated": len(pre["first_token_ids"]),
                "cache_salt": req.cache_salt}
        w.running_requests += 1
        try:
            async with self.decode_slots[w.worker_id], \
                    self.client.stream("POST", f"{w.url}/decode", json=body, timeout=None) as r:
                if r.status_code != 200:
                    raise BackendError(f"decode worker {w.worker_id} error: {(await r.aread())[:200]!r}", 502,
                                       "server_error")
                async for line in r.aiter_lines():
                    if not line:
                        continue
                    msg = json.loads(line)
                    if "error" in msg:
                        raise BackendError(f"decode worker {w.worker_id}: {msg['error']}", 502, "server_error")
                    yield GenerationChunk(token_ids=msg["token_ids"], finish_reason=msg.get("finish_reason"))
        except httpx.TransportError as e:
            self.workers.mark_unhealthy(w.worker_id)
            raise BackendError(f"decode worker {w.worker_id} failed: {e!r}", 502, "server_error") from e
        finally:
            w.running_requests -= 1

    def _correct_stale_index(self, d: RouteDecision, pre: dict, hashes: list[int]) -> None:
        """Bring the L3 view in line with what the worker found in the store (issue 7 §6): it
        reports, per probe or read, exactly which chunks were present and which were missing
        or corrupt, and only those change — valid chunks before or after a bad one stay, and
        chunks the index had lost are relearned. A plan that promised more L3 blocks than were
        loaded is counted as ``stale_index`` (DESIGN §4)."""
        for obs in pre.get("l3_observations") or []:
            self.index.observe_l3(obs["block_hashes"], [tuple(k) for k in obs["present"]],
                                  [tuple(k) for k in obs["gone"]])
        plan = d.load_plan
        if plan.l3_blocks and pre["num_cached_tokens_by_tier"].get("L3", 0) < plan.l3_blocks * self.cfg.block_size:
            self.metrics.fallbacks.labels("stale_index").inc()

    def _remember(self, req: GenerationRequest, d: RouteDecision, pre: dict, ttft_s: float) -> None:
        self.recent[req.request_id] = {
            "class": d.request_class, "pool": d.pool, "prefill_worker": d.prefill_worker,
            "decode_worker": d.decode_worker, "reuse_ratio": d.reuse_ratio, "reasons": list(d.reasons),
            "load_plan": asdict(d.load_plan), "cached_tokens_by_tier": pre["num_cached_tokens_by_tier"],
            "prompt_tokens": len(req.prompt_token_ids), "ttft_s": ttft_s}
        while len(self.recent) > 1000:
            self.recent.popitem(last=False)

    def _record_prefill(self, d: RouteDecision, pre: dict, ttft_s: float, num_prompt_tokens: int) -> None:
        m = self.metrics
        m.routed.labels(d.request_class, d.pool).inc()
        m.ttft_s.labels(d.request_class, d.pool).observe(ttft_s)
        if pre.get("queue_s") is not None:
            m.queue_time_s.labels(d.pool).observe(pre["queue_s"])
        by_tier = pre["num_cached_tokens_by_tier"]
        loaded = 0
        for tier, n in by_tier.items():
            if n:
                m.prompt_tokens.labels(tier).inc(n)
                m.prefix_hits.labels(tier).inc()
                loaded += n
        computed = max(0, num_prompt_tokens - loaded)
        m.prompt_tokens.labels("computed").inc(computed)
        bytes_per_token = self.estimates.model().kv_bytes_per_token
        for tier in ("L2", "L3"):
            m.kv_bytes.labels(tier).inc(by_tier.get(tier, 0) * bytes_per_token)
        for tier, (nbytes, seconds) in (pre.get("transfers") or {}).items():
            self.estimates.observe_transfer(tier, nbytes, seconds)
        m.kv_bytes.labels("handoff").inc(pre.get("kv_bytes", 0))
        for r in d.reasons:
            if r.startswith("recompute-"):
                m.load_decisions.labels(r.split(":")[0].split("-")[1]).inc()
        if "fallback" in pre and pre["fallback"]:
            for kind, n in pre["fallback"].items():
                m.fallbacks.labels(kind).inc(n)
        self.estimates.observe_prefill(computed, loaded, pre.get("compute_s") or pre["prefill_s"])
        cm = self.estimates.model()
        m.cost_prefill_rate.set(cm.prefill_tokens_per_s)
        m.cost_bandwidth.labels("L2").set(cm.l2_bytes_per_s)
        m.cost_bandwidth.labels("L3").set(cm.l3_bytes_per_s)


def _sampling_dict(req: GenerationRequest) -> dict:
    s = req.sampling
    return {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
            "ignore_eos": s.ignore_eos, "stop_token_ids": list(s.stop_token_ids or [])}
