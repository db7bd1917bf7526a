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
worker.

Failures (issue 7 §1, §3, §4). Every router→worker call is bounded in time
(:class:`DispatchTimeouts`). A prefill-side call that fails in transport or times out marks
the worker unhealthy, excludes it for this request and is retried on the policy's next choice.
A decode call that fails before the first decoded token is retried: on another decode worker
from the same staging (the sender holds it until the decode worker's first output), or, if the
staging is gone (stale handle, unreachable sender), after re-prefilling the prompt. After the
first decoded token a failure ends the request with a clear error (502/503; the front turns it
into an SSE error event when streaming). A request waits for a decode slot at most until its
staging's reclaim time (minus a margin), then ends with 503.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields, replace
from typing import AsyncIterator

import httpx

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.policy.routing import NoWorkerError, RouteDecision, RoutingConfig, route
from cpd.policy.routing import _pick_decode  # the policy's own decode choice (pure)
from cpd.router.estimates import CostEstimates
from cpd.router.index import PrefixIndex
from cpd.router.metrics import RouterMetrics
from cpd.router.protocol import BackendError, GenerationChunk, GenerationRequest
from cpd.router.workers import WorkerSet

log = logging.getLogger("cpd.router")


@dataclass(frozen=True)
class DispatchTimeouts:
    """Time bounds of every router→worker call (issue 7 §3); all in seconds.

    * Any call: TCP connect and connection-pool wait ≤ ``connect_s``.
    * ``POST /prefill``: the whole answer within :meth:`prefill_s` =
      ``min(prefill_cap_s, prefill_floor_s + prefill_slack × estimate)``, where ``estimate`` is
      the policy's estimated TTFT on the chosen worker (its queue + loads + compute, from the
      live cost model). Then the worker is excluded and the request retried elsewhere.
    * ``POST /decode``: response headers (the worker fetched and admitted the KV) within
      :meth:`decode_first_byte_s` = ``min(decode_cap_s, decode_floor_s + decode_slack × kv_bytes /
      handoff_bytes_per_s)``; then at most ``decode_idle_s`` between NDJSON lines (decode workers
      send a heartbeat line every 0.5 s while a request waits in their queue, so this bound is
      independent of queueing).
    * ``POST /handoff/release``: ``release_s``.
    * Decode slot: a request waits at most until its staging's reclaim time minus
      :meth:`staging_margin` (``min(staging_margin_s, lifetime / 4)``).

    Worst case for one request: ``max_prefill_attempts`` prefill bounds, then per decode attempt
    the first-byte bound (plus one re-prefill when the staging was lost). Overrides: the
    ``CPD_DISPATCH_TIMEOUTS`` environment variable of the router, a JSON object of these fields.
    """

    connect_s: float = 3.0
    prefill_floor_s: float = 30.0
    prefill_slack: float = 4.0
    prefill_cap_s: float = 900.0
    decode_floor_s: float = 15.0
    decode_slack: float = 4.0
    decode_cap_s: float = 120.0
    handoff_bytes_per_s: float = 1e9
    decode_idle_s: float = 10.0
    release_s: float = 5.0
    staging_margin_s: float = 5.0
    max_prefill_attempts: int = 2
    max_decode_attempts: int = 3

    def prefill_s(self, estimate_s: float) -> float:
        return min(self.prefill_cap_s, self.prefill_floor_s + self.prefill_slack * max(0.0, estimate_s))

    def decode_first_byte_s(self, kv_bytes: int) -> float:
        return min(self.decode_cap_s, self.decode_floor_s + self.decode_slack * max(0, kv_bytes) / self.handoff_bytes_per_s)

    def staging_margin(self, lifetime_s: float) -> float:
        return min(self.staging_margin_s, lifetime_s / 4)

    def httpx(self, read_s: float) -> httpx.Timeout:
        return httpx.Timeout(read_s, connect=self.connect_s, pool=self.connect_s)

    @classmethod
    def from_env(cls, environ=os.environ) -> "DispatchTimeouts":
        raw = environ.get("CPD_DISPATCH_TIMEOUTS")
        if not raw:
            return cls()
        known = {f.name: f.type for f in fields(cls)}
        given = json.loads(raw)
        unknown = set(given) - set(known)
        if unknown:
            raise ValueError(f"CPD_DISPATCH_TIMEOUTS: unknown fields {sorted(unknown)}")
        return cls(**given)


class _DecodeFailed(Exception):
    """A decode attempt failed in a way a retry can fix: the worker failed (transport error,
    timeout) or the staging is gone (``handoff_lost``: re-prefill)."""

    def __init__(self, msg: str, worker_failed: bool = False, handoff_lost: bool = False):
        super().__init__(msg)
        self.worker_failed, self.handoff_lost = worker_failed, handoff_lost


class _Run:
    """One request's dispatch state: workers excluded after failing it, attempt counter (each
    worker call gets its own request id, so a late answer or release of an abandoned attempt
    never touches a later one), re-prefills."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.excluded: set[str] = set()
        self.calls = 0
        self.reprefills = 0

    def worker_request_id(self) -> str:
        self.calls += 1
        return self.req.request_id if self.calls == 1 else f"{self.req.request_id}-a{self.calls}"


class CPDBackend:
    """Implements ``GenerationBackend`` over HTTP workers."""

    def __init__(self, workers: WorkerSet, index: PrefixIndex, namespace: Namespace, cfg: RoutingConfig,
                 estimates: CostEstimates, metrics: RouterMetrics, client: httpx.AsyncClient,
                 max_in_flight: int = 256, max_decode_per_worker: int = 64,
                 timeouts: DispatchTimeouts | None = None):
        self.workers = workers
        self.timeouts = timeouts or DispatchTimeouts.from_env()
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

    def decide(self, req: GenerationRequest, excluded: set[str] = frozenset()) -> tuple[RouteDecision, list[int]]:
        """Route ``req``; workers in ``excluded`` (failed for this request) are not candidates."""
        hashes = hash_blocks(req.prompt_token_ids, self.namespace.with_salt(req.cache_salt))
        match = self.index.match(hashes, l3_max_blocks=(len(req.prompt_token_ids) - 1) // self.cfg.block_size)
        try:
            d = route(len(req.prompt_token_ids), match, self._snapshots(set(excluded)), self.cfg, self.estimates.model())
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
        except (GeneratorExit, asyncio.CancelledError):  # closed at a yield, or cancelled mid-await
            outcome = "cancelled"                         # (the front cancels on client disconnect)
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        t0 = req.arrival_time if req.arrival_time is not None else time.monotonic()
        run = _Run(req)
        pre = await self._prefill_with_retry(run)
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
        async for chunk in self._decode_with_retry(run, pre):
            n_out += len(chunk.token_ids)
            yield chunk
        if n_out > 1:
            self.metrics.tpot_s.observe((time.monotonic() - t_first) / (n_out - 1))

    def _release_handoff(self, pre: dict) -> None:
        """Fire-and-forget release of a handoff nobody will fetch (the sender also reclaims
        unreleased regions after a timeout). Names the staging's generation, so a late release
        never frees a newer staging of the same id."""
        handle = pre.get("handoff")
        if not handle:
            return

        async def release():
            try:
                await self.client.post(handle["release_url"], timeout=self.timeouts.release_s,
                                       json={"request_id": handle.get("request_id"),
                                             "generation": handle.get("generation")})
            except httpx.HTTPError:
                pass
        asyncio.get_running_loop().create_task(release())

    async def _prefill_with_retry(self, run: "_Run", sampling: dict | None = None) -> dict:
        """Prefill on the policy's choice; on any transport failure or timeout, mark that worker
        unhealthy, exclude it for this request and retry on the next choice (issue 7 §3-§4)."""
        last: BaseException | None = None
        for attempt in range(self.timeouts.max_prefill_attempts):
            d, hashes = self.decide(run.req, run.excluded)
            try:
                pre = await self._prefill(run, d, sampling)
            except (httpx.TransportError, asyncio.TimeoutError) as e:
                log.warning("prefill of %s on %s failed (%r); attempt %d", run.req.request_id, d.prefill_worker,
                            e, attempt)
                self.metrics.fallbacks.labels("prefill_worker_failed").inc()
                self.workers.mark_unhealthy(d.prefill_worker)
                run.excluded.add(d.prefill_worker)
                last = e
                continue
            pre["decision"], pre["hashes"] = d, hashes
            return pre
        raise BackendError(f"prefill failed on {', '.join(sorted(run.excluded))}: {last!r}", 503,
                           "service_unavailable", retry_after_s=1)

    async def _prefill(self, run: "_Run", d: RouteDecision, sampling: dict | None = None) -> dict:
        """One ``POST /prefill``, bounded by :meth:`DispatchTimeouts.prefill_s` of the policy's
        estimate. The answer gets ``staging_deadline`` (router monotonic clock): after it the
        sender may have reclaimed the staging."""
        req = run.req
        w = self.workers.by_id[d.prefill_worker]
        n = len(req.prompt_token_ids)
        recompute_l3 = any(r.startswith("recompute-L3") for r in d.reasons)
        body = {"request_id": run.worker_request_id(), "prompt_token_ids": req.prompt_token_ids,
                "sampling": sampling or _sampling_dict(req), "cache_salt": req.cache_salt,
                "max_l3_blocks": d.load_plan.l3_blocks if recompute_l3 else None,
                "write_through": d.pool == "pre-prefill"}
        log.debug("route %s cls=%s pool=%s worker=%s plan=%s reasons=%s", req.request_id, d.request_class, d.pool,
                  d.prefill_worker, asdict(d.load_plan), d.reasons)
        cached = d.load_plan.num_cached_blocks * self.cfg.block_size
        est_s = self.estimates.model().prefill_time_s(n - cached, cached)
        limit_s = self.timeouts.prefill_s(d.estimated_ttft_s)
        w.queued_prefill_tokens += n
        w.queued_prefill_s += est_s
        w.running_requests += 1
        try:
            r = await asyncio.wait_for(
                self.client.post(f"{w.url}/prefill", json=body, timeout=self.timeouts.httpx(limit_s)),
                self.timeouts.connect_s + limit_s)
        finally:
            w.queued_prefill_tokens -= n
            w.queued_prefill_s -= est_s
            w.running_requests -= 1
        if r.status_code != 200:
            raise BackendError(f"prefill worker {w.worker_id} error: {r.text[:200]}", 502, "server_error")
        pre = r.json()
        handle = pre.get("handoff")
        if handle:
            life_s = float(handle.get("reclaim_after_s", 120.0))
            pre["staging_deadline"] = time.monotonic() + life_s - self.timeouts.staging_margin(life_s)
        return pre

    async def _decode_with_retry(self, run: "_Run", pre: dict) -> AsyncIterator[GenerationChunk]:
        """Decode from ``pre``'s handoff. A failure before the first decoded token is retried:
        a decode worker that failed (transport error, timeout) is excluded and the same staging
        is fetched by another one; a staging that is gone (stale, sender unreachable) is
        re-prefilled. The tokens already sent (``pre["token_ids"]``) stay: only the KV of the
        prompt is recomputed. After a decoded token, a failure ends the request with an error."""
        token_ids, num_generated = pre["token_ids"], len(pre["first_token_ids"])
        decode_worker, handoff = pre["decision"].decode_worker, pre
        sent = False
        try:
            for attempt in range(self.timeouts.max_decode_attempts):
                try:
                    async for chunk in self._decode(run, decode_worker, handoff, token_ids, num_generated):
                        sent = True
                        yield chunk
                    return
                except _DecodeFailed as e:
                    if e.worker_failed:
                        self.workers.mark_unhealthy(decode_worker)  # the poller restores it if it answers
                        run.excluded.add(decode_worker)
                    if sent:
                        raise BackendError(f"decode worker {decode_worker} failed mid-stream: {e}", 502,
                                           "server_error") from e
                    log.warning("decode of %s on %s failed before its first token (%s); attempt %d",
                                run.req.request_id, decode_worker, e, attempt)
                    self.metrics.fallbacks.labels("decode_retry").inc()
                    expired = time.monotonic() >= handoff["staging_deadline"]  # likely reclaimed by now
                    if (e.handoff_lost or expired) and attempt + 1 < self.timeouts.max_decode_attempts:
                        self._release_handoff(handoff)
                        handoff = await self._reprefill(run)
                    decode_worker = _pick_decode(self._snapshots(run.excluded))
                    self._note_decode_retry(run, decode_worker, e)
                    if decode_worker is None:
                        raise BackendError(f"decode failed ({e}); no other healthy decode worker", 503,
                                           "service_unavailable", retry_after_s=1) from e
            raise BackendError(f"decode failed on {self.timeouts.max_decode_attempts} attempts", 503,
                               "service_unavailable", retry_after_s=1)
        finally:
            if not sent:  # never decoded from it: nobody else will release it
                self._release_handoff(handoff)

    async def _reprefill(self, run: "_Run") -> dict:
        """Recompute the prompt's KV for a new staging. Its sampled token is discarded (the
        client already has the first token), so it is sampled greedily with ``max_tokens=2``:
        the prefill always ends in a handoff."""
        self.metrics.fallbacks.labels("handoff_reprefill").inc()
        run.reprefills += 1
        sampling = dict(_sampling_dict(run.req), max_tokens=2, temperature=0.0, ignore_eos=True, stop_token_ids=[])
        pre = await self._prefill_with_retry(run, sampling)
        if not pre.get("handoff"):
            raise BackendError("re-prefill ended without a handoff", 502, "server_error")
        return pre

    async def _decode(self, run: "_Run", worker_id: str, pre: dict, token_ids: list[int],
                      num_generated: int) -> AsyncIterator[GenerationChunk]:
        """One ``POST /decode`` stream, every wait bounded (:class:`DispatchTimeouts`): the
        decode slot until the staging's deadline, the response headers, then each NDJSON line.
        Raises :class:`_DecodeFailed` for what a retry can fix, :class:`BackendError` otherwise."""
        req, w = run.req, self.workers.by_id[worker_id]
        body = {"request_id": run.worker_request_id(), "token_ids": token_ids, "sampling": _sampling_dict(req),
                "handoff": pre["handoff"], "num_generated": num_generated, "cache_salt": req.cache_salt}
        slots = self.decode_slots[w.worker_id]
        try:  # a free slot is taken at once; a wait for one ends before the staging's deadline
            await asyncio.wait_for(slots.acquire(), None if not slots.locked() else
                                   max(0.0, pre["staging_deadline"] - time.monotonic()))
        except asyncio.TimeoutError:
            self.metrics.fallbacks.labels("decode_slot_timeout").inc()
            raise BackendError(f"no decode slot on {w.worker_id} within the handoff staging's lifetime "
                               "(decode pool saturated)", 503, "service_unavailable", retry_after_s=1) from None
        w.running_requests += 1
        r = None
        try:
            first_byte_s = self.timeouts.decode_first_byte_s(int(pre.get("kv_bytes") or 0))
            http_req = self.client.build_request("POST", f"{w.url}/decode", json=body,
                                                 timeout=self.timeouts.httpx(max(first_byte_s, self.timeouts.decode_idle_s)))
            r = await asyncio.wait_for(self.client.send(http_req, stream=True), self.timeouts.connect_s + first_byte_s)
            if r.status_code != 200:
                await self._decode_refused(w.worker_id, r)
            lines = r.aiter_lines().__aiter__()
            while True:
                try:
                    line = await asyncio.wait_for(lines.__anext__(), self.timeouts.decode_idle_s)
                except StopAsyncIteration:
                    raise _DecodeFailed("stream ended without a finish_reason", worker_failed=True) from None
                if not line:
                    continue  # heartbeat
                msg = json.loads(line)
                if "error" in msg:
                    raise BackendError(f"decode worker {w.worker_id}: {msg['error']}", 502, "server_error")
                yield GenerationChunk(token_ids=msg["token_ids"], finish_reason=msg.get("finish_reason"))
                if msg.get("finish_reason") is not None:
                    return
        except (httpx.TransportError, asyncio.TimeoutError) as e:
            raise _DecodeFailed(f"{type(e).__name__}: {e}", worker_failed=True) from e
        finally:
            w.running_requests -= 1
            slots.release()
            if r is not None:
                await r.aclose()

    async def _decode_refused(self, worker_id: str, r: httpx.Response) -> None:
        """A non-200 answer to ``POST /decode``: a lost staging is retryable, the rest is not."""
        text = (await r.aread())[:300].decode(errors="replace")
        try:
            code = json.loads(text).get("code")
        except ValueError:
            code = None
        if r.status_code == 410 or code in ("handoff_stale", "handoff_unavailable"):
            self.metrics.fallbacks.labels("handoff_stale" if r.status_code == 410 else "handoff_unavailable").inc()
            raise _DecodeFailed(f"handoff lost ({r.status_code}): {text}", handoff_lost=True)
        raise BackendError(f"decode worker {worker_id} error: {text}", 502, "server_error")

    def _snapshots(self, excluded: set[str]) -> list:
        """Worker load snapshots with this request's excluded workers marked unhealthy."""
        return [replace(s, healthy=False) if s.worker_id in excluded else s for s in self.workers.snapshots()]

    def _note_decode_retry(self, run: "_Run", decode_worker: str | None, e: "_DecodeFailed") -> None:
        rec = self.recent.get(run.req.request_id)
        if rec is not None:
            rec["decode_worker"] = decode_worker
            rec["reprefills"] = run.reprefills
            rec.setdefault("decode_failures", []).append(str(e)[:200])

    def _correct_stale_index(self, d: RouteDecision, pre: dict, hashes: list[int]) -> None:
        """Bring the L3 view in line with what the worker found in the store (issue 7 §6): it
        reports, per probe or read, exactly which chunks were present and which were missing
        or corrupt, and only those change — valid chunks before or after a bad one stay, and
        chunks the index had lost are relearned. A plan that promised more L3 blocks than were
        loaded is counted as ``stale_index`` (DESIGN §4)."""
        # the probes happened during the prefill call (``prefill_s`` long, timed by the worker):
        # chunks learned since it began (e.g. from this request's own write-through, sealed
        # after its probe) may be newer than a probe and are spared
        since = time.monotonic() - float(pre.get("prefill_s") or 0.0)
        for obs in pre.get("l3_observations") or []:
            self.index.observe_l3(obs["block_hashes"], [tuple(k) for k in obs["present"]],
                                  [tuple(k) for k in obs["gone"]], since=since)
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
