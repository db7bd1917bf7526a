"""The CPD backend of the router: route, prefill, hand off, relay decode tokens.

Per request (docs/architecture.md request flow):

1. Hash the prompt's full blocks (:mod:`cpd.kv.block_hash`, tenant salt applied).
2. Ask the pure policy (:func:`cpd.policy.routing.route`) with the index match and
   load snapshots → pool, prefill-side worker, load plan, decode worker.
3. ``POST /prefill`` on the chosen worker (pre-prefill writes through to L3; prefill
   loads its prefix from L1/L2/L3). It answers with the first token and a handoff
   handle. The first token is yielded at once (TTFT).
4. ``POST /decode`` on the decode worker with the handle; relay its NDJSON stream.

Adaptive decisions (issue 11) add three paths around these steps:

* Admission: :class:`cpd.policy.routing.Overloaded` → 429 with ``Retry-After`` from the
  prediction (counted in ``cpd_admission_rejected_total``), on a request's first decision only:
  its retries, re-prefills and an append's fallback are the server's recovery, never refused.
* Read-after-write: a decision with ``write_through`` announces the blocks it will write to L3
  (:meth:`cpd.router.index.PrefixIndex.add_pending_writes`, predicted visible at the prefill's
  predicted end + ``raw_ready_margin_s``); a decision with ``wait_for_l3_s > 0`` is held until the
  router's L3 view shows the pending run or the wait (at most ``raw_wait_max_s``) passes, then
  decided again and dispatched whatever it says (the engine recomputes what is missing).
* Decode-local append (``decision.decode_append``): one ``POST /append`` on the decode worker
  holding the prefix (the suffix prefilled there, then decoded, no handoff), relayed like a
  decode. Its first token is due within the prefill bound of its estimate
  (:meth:`DispatchTimeouts.prefill_s`; heartbeats do not extend it). If the append fails before
  its first token, whatever the failure (transport, timeout, refusal, an error line), the request
  is routed again without an append (a worker that failed in transport or time is excluded);
  after tokens have streamed, a failed worker's append is migrated as a decode would be
  (``timeouts.max_decode_migrations``).

Closing the generator (client disconnect, stop string) cancels the in-flight HTTP
call, which the worker sees as a disconnect and aborts — blocks are freed on every
worker.

Failures (issue 7 §1, §3, §4). Every router→worker call is bounded in time
(:class:`DispatchTimeouts`; a prefill by its progress, not by its estimate:
:mod:`cpd.router.prefill_relay`). A prefill-side call that fails in transport or times out marks
the worker unhealthy, excludes it for this request and is retried on the policy's next choice.
A decode call that fails before the first decoded token is retried: on another decode worker
from the same staging (the sender holds it until the decode worker's first output), or, if the
staging is gone (stale handle, unreachable sender), after re-prefilling the prompt. After the
first decoded token a failure ends the request with a clear error (502/503; the front turns it
into an SSE error event when streaming). A request waits for a decode slot at most until its
staging's reclaim time (minus a margin), then ends with 503.

Bodies are the typed messages of :mod:`cpd.messages.worker_api`. Around this module:
:mod:`cpd.router.timeouts` (the bounds), :mod:`cpd.router.decode_relay` (one decode stream),
:mod:`cpd.router.dispatch_records` (metrics and ``/cpd/requests`` records).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, AsyncGenerator, cast

import httpx

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.messages.handoff import HandoffHandle, HandoffRelease
from cpd.messages.sampling import SamplingParams
from cpd.messages.worker_api import AppendRequest, DecodeLine, DecodeRequest, PrefillAnswer, PrefillRequest
from cpd.policy.routing import NoWorkerError, Overloaded, PrefixMatch, RouteDecision, RoutingConfig, route
from cpd.policy.routing import max_cached_blocks, pick_decode, work_s
from cpd.router.decode_relay import DecodeFailed, relay_decode
from cpd.router.dispatch_records import RecentRequests, record_prefill
from cpd.router.estimates import CostEstimates
from cpd.router.index import PrefixIndex
from cpd.router.metrics import RouterMetrics
from cpd.router.prefill_relay import post_prefill
from cpd.router.protocol import BackendError, GenerationChunk, GenerationRequest
from cpd.router.staging_release import StagingReleaser
from cpd.router.timeouts import DispatchTimeouts
from cpd.router.workers import WorkerInfo, WorkerSet
from cpd.types import PREFILL_SIDE_ROLES, BlockHash, Role, Tier

if TYPE_CHECKING:
    from cpd.policy.role_window import RoleWindow

log = logging.getLogger("cpd.router")
RAW_POLL_S = 0.02  # read-after-write: how often a held dispatch looks at the L3 view

__all__ = ["CPDBackend", "DispatchTimeouts"]


@dataclass(frozen=True)
class _Prefilled:
    """A prefill's answer with what the router decided for it. ``staging_deadline`` (router
    monotonic clock): after it the sender may have reclaimed the staging."""

    answer: PrefillAnswer
    decision: RouteDecision
    hashes: list[BlockHash]
    staging_deadline: float

    @property
    def handoff(self) -> HandoffHandle | None:
        return self.answer.handoff


class _Run:
    """One request's dispatch state: workers excluded after failing it, attempt counter (each
    worker call gets its own request id, so a late answer or release of an abandoned attempt
    never touches a later one), re-prefills."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.t0 = req.arrival_time if req.arrival_time is not None else time.monotonic()
        self.excluded: set[str] = set()
        self.calls = 0
        self.reprefills = 0
        self.raw_wait_s = 0.0  # read-after-write hold before the first dispatch

    def worker_request_id(self) -> str:
        self.calls += 1
        return self.req.request_id if self.calls == 1 else f"{self.req.request_id}-a{self.calls}"


class CPDBackend:
    """Implements ``GenerationBackend`` over HTTP workers."""

    def __init__(self, workers: WorkerSet, index: PrefixIndex, namespace: Namespace, cfg: RoutingConfig,
                 estimates: CostEstimates, metrics: RouterMetrics, client: httpx.AsyncClient,
                 max_in_flight: int = 256, max_decode_per_worker: int = 64,
                 timeouts: DispatchTimeouts | None = None, raw_ready_margin_s: float = 0.25,
                 queue_remaining: bool = False):
        self.workers = workers
        self.queue_remaining = queue_remaining  # queued_prefill_s: a started prefill counts what remains
        self.raw_ready_margin_s = raw_ready_margin_s  # pending L3 writes: visible this long after the prefill
        self.role_window: RoleWindow | None = None  # elastic roles: fed with every prefill (cpd.router.elastic)
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
        self.recent = RecentRequests()  # request_id -> routing record (bounded)
        self.releaser = StagingReleaser(self.timeouts, metrics)

    def decide(self, req: GenerationRequest, excluded: set[str] | frozenset[str] = frozenset(),
               allow_append: bool = True, allow_raw: bool = True,
               admit: bool = True) -> tuple[RouteDecision, list[BlockHash]]:
        """Route ``req``; workers in ``excluded`` (failed for this request) are not candidates;
        ``allow_append=False`` rules out a decode-local append (a re-prefill needs a handoff);
        ``allow_raw=False`` rules out a read-after-write hold (retries are dispatched at once, so
        their plan must count visible blocks only); ``admit=False`` skips SLO-predictive
        admission (a retry of a request already admitted: the server's recovery, never a 429).

        Raises:
            BackendError: 503 without a usable worker, 429 (``Retry-After`` from the prediction)
                when SLO-predictive admission refuses the request."""
        d, hashes, _ = self._decide(req, excluded, allow_append, allow_raw, admit)
        return d, hashes

    def _decide(self, req: GenerationRequest, excluded: set[str] | frozenset[str], allow_append: bool,
                allow_raw: bool = True, admit: bool = True) -> tuple[RouteDecision, list[BlockHash], PrefixMatch]:
        """``allow_raw=False``: no read-after-write (the decision counts visible blocks only);
        ``admit=False``: no admission (rule A6)."""
        hashes = cast(list[BlockHash], hash_blocks(req.prompt_token_ids, self.namespace.with_salt(req.cache_salt)))
        cap = max_cached_blocks(len(req.prompt_token_ids), self.cfg.block_size)
        match = self.index.match(hashes, l3_max_blocks=cap)
        cfg = self.cfg if allow_append else replace(self.cfg, decode_append_max_tokens=0)
        if not allow_raw:
            cfg = replace(cfg, raw_wait_max_s=0.0)
        if not admit:
            cfg = replace(cfg, admission_factor=None)
        try:
            d = route(len(req.prompt_token_ids), match, self._snapshots(set(excluded)), cfg, self.estimates.model())
        except NoWorkerError as e:
            raise BackendError(str(e), 503, "service_unavailable") from e
        except Overloaded as e:
            self.metrics.admission_rejected.inc()
            self.metrics.predicted_ttft_rejected_s.observe(e.predicted_ttft_s)
            raise BackendError(f"overloaded: {e}; retry later", 429, "rate_limit_exceeded",
                               code="slo_admission", retry_after_s=max(0.0, e.retry_after_s)) from e
        if d.decode_worker is None:
            raise BackendError("no healthy decode worker", 503, "service_unavailable")
        return d, hashes, match

    async def _decide_first(self, run: _Run) -> tuple[RouteDecision, list[BlockHash]]:
        """The first decision of a request, after the read-after-write hold it asks for (if
        any): the request is then decided again on what is visible now (no second hold, and no
        plan that counts blocks still pending) and dispatched whatever that says."""
        d, hashes, match = self._decide(run.req, run.excluded, allow_append=True)
        if d.wait_for_l3_s <= 0 or match.l3_pending <= match.l3:
            return d, hashes
        bound_s = min(d.wait_for_l3_s, self.cfg.raw_wait_max_s)
        cap = max_cached_blocks(len(run.req.prompt_token_ids), self.cfg.block_size)
        run.raw_wait_s, visible = await self._wait_for_l3(hashes, match.l3_pending, bound_s, cap)
        self.metrics.raw_waits.labels("visible" if visible else "timeout").inc()
        self.metrics.raw_wait_s.observe(run.raw_wait_s)
        d, hashes, _ = self._decide(run.req, run.excluded, allow_append=True, allow_raw=False, admit=False)
        return d, hashes

    async def _wait_for_l3(self, hashes: list[BlockHash], target_blocks: int, bound_s: float,
                           l3_max_blocks: int) -> tuple[float, bool]:
        """Wait until the router's L3 view shows ``target_blocks`` leading blocks, at most
        ``bound_s``; returns (seconds waited, whether they showed up)."""
        t0 = time.monotonic()
        while True:
            if self.index.match(hashes, l3_max_blocks=l3_max_blocks).l3 >= target_blocks:
                return time.monotonic() - t0, True
            left = bound_s - (time.monotonic() - t0)
            if left <= 0:
                return time.monotonic() - t0, False
            await asyncio.sleep(min(RAW_POLL_S, left))

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        if self.in_flight >= self.max_in_flight:
            self.metrics.requests.labels("rejected").inc()
            raise BackendError("too many requests in flight", 429, "rate_limit_exceeded", retry_after_s=1)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        outcome = "error"
        try:
            async with aclosing(self._generate(req)) as chunks:
                async for chunk in chunks:
                    yield chunk
                    if chunk.finish_reason is not None:
                        outcome = "ok"
        except BackendError as e:
            if e.status == 429:  # refused (SLO-predictive admission), not failed
                outcome = "rejected"
            raise
        except (GeneratorExit, asyncio.CancelledError):  # closed at a yield, or cancelled mid-await
            # the front closes on client disconnect (cancelled) or once a stop string matched (done)
            outcome = "ok" if req.control.stop_matched else "cancelled"
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()

    async def _generate(self, req: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        run = _Run(req)
        d, hashes = await self._decide_first(run)
        if d.decode_append:
            decoded: list[int] = []  # tokens the client has from the append
            try:
                async with aclosing(self._append(run, d)) as chunks:
                    async for chunk in chunks:
                        decoded.extend(chunk.token_ids)
                        yield chunk
                return
            except (DecodeFailed, BackendError) as e:
                if decoded:  # the client has tokens: migrate if allowed, else a mid-stream error
                    if isinstance(e, BackendError):
                        raise
                    if not e.worker_failed or self.timeouts.max_decode_migrations <= 0:
                        raise BackendError(f"decode worker {d.decode_worker} failed mid-stream: {e}", 502,
                                           "server_error") from e
                    async with aclosing(self._migrate_append(run, d, decoded, e)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
                log.warning("decode-local append of %s on %s failed before its first token (%s); rerouting",
                            req.request_id, d.decode_worker, e)
                self.metrics.decode_appends.labels("fallback").inc()
                if isinstance(e, DecodeFailed) and e.worker_failed and d.decode_worker is not None:
                    self.workers.mark_unhealthy(d.decode_worker)
                    run.excluded.add(d.decode_worker)
                first = None
        else:
            first = (d, hashes)
        async with aclosing(self._disaggregated(run, first)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _disaggregated(self, run: _Run, first: tuple[RouteDecision, list[BlockHash]] | None
                             ) -> AsyncGenerator[GenerationChunk, None]:
        """Prefill on a prefill-side worker, hand off, decode on a decode worker."""
        req = run.req
        pre = await self._prefill_with_retry(run, first=first)
        ans, d = pre.answer, pre.decision
        ttft = time.monotonic() - run.t0
        n_prompt = len(req.prompt_token_ids)
        record_prefill(self.metrics, self.estimates, d, ans, ttft, n_prompt)
        self.recent.remember(req.request_id, d, ans, n_prompt, ttft, raw_wait_s=run.raw_wait_s)
        try:
            yield GenerationChunk(token_ids=ans.first_token_ids, finish_reason=ans.finish_reason,
                                  num_cached_tokens=min(ans.num_cached_tokens, n_prompt))
        except GeneratorExit:  # gone before decode started: free the staged handoff now
            self._release_handoff(pre.handoff)
            raise
        if ans.finish_reason is not None:
            return
        n_out = len(ans.first_token_ids)
        t_first = time.monotonic()
        assert d.decode_worker is not None  # decide() refuses decisions without one
        staged_ids = list(req.prompt_token_ids) + list(ans.first_token_ids)  # the staged sequence (PrefillAnswer)
        async with aclosing(self._decode_with_retry(run, pre, staged_ids, n_out, d.decode_worker)) as chunks:
            async for chunk in chunks:
                n_out += len(chunk.token_ids)
                yield chunk
        if n_out > 1:
            self.metrics.tpot_s.observe((time.monotonic() - t_first) / (n_out - 1))

    async def _append(self, run: _Run, d: RouteDecision) -> AsyncGenerator[GenerationChunk, None]:
        """Decode-local append: the whole generation on ``d.decode_worker`` (``POST /append``).
        Its predicted prefill counts in that worker's queue until the first token. Raises
        :class:`DecodeFailed` when the worker fails (the caller reroutes if nothing was sent)."""
        req = run.req
        assert d.decode_worker is not None
        w = self.workers.by_id[d.decode_worker]
        n = len(req.prompt_token_ids)
        est_s = work_s(d.load_plan, n, self.cfg, self.estimates.model())
        body = AppendRequest(request_id=run.worker_request_id(), prompt_token_ids=req.prompt_token_ids,
                             sampling=req.sampling, cache_salt=req.cache_salt, expect_boot_id=w.boot_id)
        log.debug("route %s decode-append on %s plan=%s", req.request_id, w.worker_id, dataclasses.asdict(d.load_plan))
        first: list[DecodeLine] = []
        w.queued_prefill_tokens += n
        self._queue(w, body.request_id, est_s)
        queued = True

        def unqueue() -> None:
            nonlocal queued
            if queued:
                queued = False
                w.queued_prefill_tokens -= n
                w.queued.remove(body.request_id)

        deadline = time.monotonic() + self.timeouts.prefill_s(d.estimated_ttft_s)
        n_out, t_first, started = 0, 0.0, False
        outcome = "error"  # once started: ok (finished, or a stop string matched), cancelled or error
        try:
            async with aclosing(relay_decode(self.client, self.timeouts, self.metrics, w,
                                             self.decode_slots[w.worker_id], body, deadline, 0,
                                             path="/append", on_first_line=first.append,
                                             first_token_deadline=deadline)) as chunks:
                async for chunk in chunks:
                    if not started:
                        started = True
                        unqueue()
                        t_first = time.monotonic()
                        self._record_append(run, d, first[0], t_first - run.t0, n)
                        chunk = replace(chunk, num_cached_tokens=min(n, sum((first[0].num_cached_tokens_by_tier
                                                                             or {}).values())))
                    n_out += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        outcome = "ok"
                    yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            if outcome != "ok":  # closed after its last chunk is still a finished append
                outcome = "ok" if req.control.stop_matched else "cancelled"
            raise
        finally:
            unqueue()
            if started:  # before its first token the caller counts a fallback
                self.metrics.decode_appends.labels(outcome).inc()
        if n_out > 1:
            self.metrics.tpot_s.observe((time.monotonic() - t_first) / (n_out - 1))

    def _record_append(self, run: _Run, d: RouteDecision, line: DecodeLine, ttft_s: float, n_prompt: int) -> None:
        """Metrics and the ``/cpd/requests`` record of an append, from its first line (the
        figures a prefill answer would carry)."""
        ans = PrefillAnswer(first_token_ids=list(line.token_ids), finish_reason=line.finish_reason,
                            num_cached_tokens_by_tier=dict(line.num_cached_tokens_by_tier or {}),
                            prefill_s=ttft_s, queue_s=line.queue_s,
                            compute_s=None if line.queue_s is None else max(0.0, ttft_s - line.queue_s))
        record_prefill(self.metrics, self.estimates, d, ans, ttft_s, n_prompt)
        self.recent.remember(run.req.request_id, d, ans, n_prompt, ttft_s, raw_wait_s=run.raw_wait_s)

    def _release_staging_of(self, worker_url: str, worker_request_id: str) -> None:
        """Fire-and-forget release of whatever a prefill worker staged under ``worker_request_id``
        (unique per prefill attempt, :meth:`_Run.worker_request_id`: no other staging has it) when
        the router gave up on that attempt before reading its answer; nothing staged: a no-op."""
        self._post_release(f"{worker_url}/handoff/release", HandoffRelease(worker_request_id))

    def _release_handoff(self, handle: HandoffHandle | None) -> None:
        """Fire-and-forget release of a handoff nobody will fetch (the sender also reclaims
        unreleased regions after a timeout). Names the staging's generation, so a late release
        never frees a newer staging of the same id."""
        if handle is None or handle.release_url is None:
            return
        self._post_release(handle.release_url, HandoffRelease(handle.request_id, handle.generation))

    def _post_release(self, url: str, msg: HandoffRelease) -> None:
        self.releaser.release(self.client, url, msg)  # retried until the worker answers (bounded)

    async def _prefill_with_retry(self, run: _Run, sampling: SamplingParams | None = None,
                                  first: tuple[RouteDecision, list[BlockHash]] | None = None) -> _Prefilled:
        """Prefill on the policy's choice (``first``: the decision already made for the first
        attempt); on any transport failure or timeout, mark that worker unhealthy, exclude it for
        this request and retry on the next choice (issue 7 §3-§4)."""
        last: BaseException | None = None
        for attempt in range(self.timeouts.max_prefill_attempts):
            if attempt == 0 and first is not None:
                d, hashes = first
            else:
                # a retry, a re-prefill or an append's fallback: the request was admitted already
                d, hashes = self.decide(run.req, run.excluded, allow_append=False, allow_raw=False, admit=False)
            try:
                ans = await self._prefill(run, d, hashes, sampling)
            except (httpx.TransportError, asyncio.TimeoutError) as e:
                log.warning("prefill of %s on %s failed (%r); attempt %d", run.req.request_id, d.prefill_worker,
                            e, attempt)
                self.metrics.fallbacks.labels("prefill_worker_failed").inc()
                self.workers.mark_unhealthy(d.prefill_worker)
                run.excluded.add(d.prefill_worker)
                last = e
                continue
            deadline = float("inf")
            if ans.handoff is not None:
                life_s = ans.handoff.reclaim_after_s
                deadline = time.monotonic() + life_s - self.timeouts.staging_margin(life_s)
            return _Prefilled(ans, d, hashes, deadline)
        raise BackendError(f"prefill failed on {', '.join(sorted(run.excluded))}: {last!r}", 503,
                           "service_unavailable", retry_after_s=1)

    def _queue(self, w: WorkerInfo, key: str, est_s: float) -> None:
        """``key``'s own work ``est_s`` counts in ``w``'s ``queued_prefill_s`` until its first token
        (with ``queue_remaining``, once its worker reports it running, only what remains of it)."""
        w.queued.count_elapsed = self.queue_remaining
        w.queued.add(key, est_s)

    async def _prefill(self, run: _Run, d: RouteDecision, hashes: list[BlockHash],
                       sampling: SamplingParams | None = None) -> PrefillAnswer:
        """One ``POST /prefill``, streamed with progress and bounded by it
        (:func:`cpd.router.prefill_relay.post_prefill`), never by the policy's estimate: an
        estimate that is wrong must not fail a prefill that is making progress. With ``write_through`` the blocks it computes are announced as pending L3
        writes (read-after-write) until they show up, expire, or the call fails."""
        req = run.req
        w = self.workers.by_id[d.prefill_worker]
        n = len(req.prompt_token_ids)
        recompute_l3 = d.recompute is not None and d.recompute.tier == Tier.L3
        body = PrefillRequest(request_id=run.worker_request_id(), prompt_token_ids=req.prompt_token_ids,
                              sampling=sampling or req.sampling, cache_salt=req.cache_salt,
                              max_l3_blocks=d.load_plan.l3_blocks if recompute_l3 else None,
                              write_through=d.write_through, expect_boot_id=w.boot_id)
        log.debug("route %s cls=%s pool=%s worker=%s plan=%s reasons=%s", req.request_id, d.request_class, d.pool,
                  d.prefill_worker, dataclasses.asdict(d.load_plan), d.reasons)
        cached_blocks = d.load_plan.num_cached_blocks
        est_s = work_s(d.load_plan, n, self.cfg, self.estimates.model())
        now = time.monotonic()
        pending = hashes[cached_blocks:] if d.write_through else []
        if pending:
            self.index.add_pending_writes(pending, now + d.estimated_ttft_s + self.raw_ready_margin_s)
        if self.role_window is not None and d.pool in PREFILL_SIDE_ROLES:
            self.role_window.observe_dispatch(now, d, est_s)
        w.queued_prefill_tokens += n
        self._queue(w, body.request_id, est_s)
        w.running_requests += 1
        if d.pool in PREFILL_SIDE_ROLES:  # rule A3 prices a pool's arrivals with them
            w.rates.observe(now, d.request_class, est_s)
        dw = self.workers.by_id.get(d.decode_worker) if d.decode_worker is not None else None
        if dw is not None:  # routing rule 6: the decode worker counts the handoff it will receive
            dw.pending_handoffs += 1
        ok = False
        try:
            ans = await post_prefill(self.client, self.timeouts, f"{w.url}/prefill", w.worker_id, body,
                                     on_running=lambda: w.queued.start(body.request_id, time.monotonic()))
            ok = True
        except (asyncio.CancelledError, httpx.TransportError, asyncio.TimeoutError):
            # abandoned (client gone, worker failed): the worker may have staged the KV and written its
            # answer already (it cannot tell an unread answer), so free this attempt's staging by its id
            self._release_staging_of(w.url, body.request_id)
            raise
        finally:
            w.queued_prefill_tokens -= n
            w.queued.remove(body.request_id)
            w.running_requests -= 1
            if dw is not None:  # from here the decode relay counts it in running_requests
                dw.pending_handoffs -= 1
            if pending and not ok:
                self.index.drop_pending_writes(pending)
        self._correct_stale_index(d, ans, sent_s=now)
        if self.role_window is not None and Role(w.role) in PREFILL_SIDE_ROLES:
            self.role_window.observe_prefill_done(time.monotonic(), Role(w.role), ans.queue_s or 0.0,
                                                  time.monotonic() - run.t0)
        return ans

    async def _migrate_append(self, run: _Run, d: RouteDecision, decoded: list[int],
                              error: DecodeFailed) -> AsyncGenerator[GenerationChunk, None]:
        """A decode-local append whose worker failed after ``decoded`` reached the client: as a
        mid-stream decode (:meth:`_decode_with_retry`), the prompt and ``decoded`` are
        re-prefilled and decoding goes on on another decode worker (one migration used)."""
        assert d.decode_worker is not None
        self.workers.mark_unhealthy(d.decode_worker)
        run.excluded.add(d.decode_worker)
        token_ids = list(run.req.prompt_token_ids) + decoded
        log.warning("decode-local append of %s on %s failed after %d tokens (%s); migrating", run.req.request_id,
                    d.decode_worker, len(decoded), error)
        staged = await self._migrate(run, token_ids)
        try:
            worker = self._next_decode_worker(run, staged, len(token_ids), error, "decode-local append failed mid-stream")
        except BackendError:
            self._release_handoff(staged.handoff)
            raise
        async with aclosing(self._decode_with_retry(run, staged, token_ids, len(decoded), worker, 1)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _decode_with_retry(self, run: _Run, pre: _Prefilled, token_ids: list[int], num_generated: int,
                                 decode_worker: str, migrations: int = 0) -> AsyncGenerator[GenerationChunk, None]:
        """Decode from ``pre``'s handoff. A failure before the first decoded token is retried:
        a decode worker that failed (transport error, timeout) is excluded and the same staging
        is fetched by another one; a staging that is gone (stale, sender unreachable) is
        re-prefilled. The tokens already sent (``pre.answer.token_ids``) stay: only the KV of the
        prompt is recomputed. After a decoded token, a failed worker's request is *migrated* up to
        ``timeouts.max_decode_migrations`` times (:meth:`_migrate`: the prompt and every token
        sent so far are re-prefilled, decoding goes on elsewhere with the same sampling state);
        past that, or for any other failure, it ends with an error."""
        staged = pre
        sent = False  # this staging was decoded from (the client has tokens of it)
        decoded: list[int] = []  # tokens decoded from this staging
        try:
            for attempt in range(self.timeouts.max_decode_attempts + self.timeouts.max_decode_migrations):
                try:
                    async with aclosing(self._decode(run, decode_worker, staged, token_ids, num_generated)) as chunks:
                        async for chunk in chunks:
                            sent = True
                            decoded.extend(chunk.token_ids)
                            yield chunk
                    return
                except DecodeFailed as e:
                    if e.worker_failed:
                        self.workers.mark_unhealthy(decode_worker)  # the poller restores it if it answers
                        run.excluded.add(decode_worker)
                    if sent and (not e.worker_failed or migrations >= self.timeouts.max_decode_migrations):
                        raise BackendError(f"decode worker {decode_worker} failed mid-stream: {e}", 502,
                                           "server_error") from e
                    if sent:  # migrate: the failed worker had the staging; a new one holds the tokens so far
                        migrations += 1
                        token_ids, num_generated = token_ids + decoded, num_generated + len(decoded)
                        decoded, sent = [], False
                        log.warning("decode of %s on %s failed after %d tokens (%s); migrating", run.req.request_id,
                                    decode_worker, num_generated, e)
                        staged = await self._migrate(run, token_ids)
                        decode_worker = self._next_decode_worker(run, staged, len(token_ids), e,
                                                                 "decode failed mid-stream")
                        continue
                    log.warning("decode of %s on %s failed before its first token (%s); attempt %d",
                                run.req.request_id, decode_worker, e, attempt)
                    self.metrics.fallbacks.labels("decode_retry").inc()
                    expired = time.monotonic() >= staged.staging_deadline  # likely reclaimed by now
                    if e.sender_unreachable:  # a re-prefill there would stage where this decode worker cannot fetch
                        run.excluded.add(staged.decision.prefill_worker)
                    if (e.handoff_lost or expired) and attempt + 1 < self.timeouts.max_decode_attempts:
                        self._release_handoff(staged.handoff)
                        staged = await self._reprefill(run)
                    decode_worker = self._next_decode_worker(run, staged, len(run.req.prompt_token_ids), e,
                                                             "decode failed")
            raise BackendError(f"decode failed on {self.timeouts.max_decode_attempts} attempts", 503,
                               "service_unavailable", retry_after_s=1)
        finally:
            if not sent:  # never decoded from it: nobody else will release it
                self._release_handoff(staged.handoff)

    def _next_decode_worker(self, run: _Run, staged: _Prefilled, num_tokens: int, error: DecodeFailed,
                            what: str) -> str:
        """The decode worker to try ``staged`` on after ``error`` (the request's excluded workers
        left out; the retry recorded on the request), or a 503 ``"<what> (<error>); ..."`` when
        no healthy one is left."""
        worker = pick_decode(self._snapshots(run.excluded), self.index.match(staged.hashes), num_tokens, self.cfg)
        self.recent.note_decode_retry(run.req.request_id, worker, run.reprefills, str(error))
        if worker is None:
            raise BackendError(f"{what} ({error}); no other healthy decode worker", 503, "service_unavailable",
                               retry_after_s=1) from error
        return worker

    async def _migrate(self, run: _Run, token_ids: list[int]) -> _Prefilled:
        """A new staging for a decode that failed mid-stream: the KV of ``token_ids[:-1]`` (the
        prompt and every token sent but the last, which is the next decode input) recomputed on
        a prefill worker, its cached prefix loaded as for any prompt (:meth:`_reprefill`)."""
        self.metrics.fallbacks.labels("decode_migration").inc()
        moved = _Run(replace(run.req, prompt_token_ids=token_ids[:-1]))
        moved.excluded, moved.calls, moved.t0 = run.excluded, run.calls, run.t0
        try:
            return await self._reprefill(moved)
        finally:
            run.calls, run.reprefills = moved.calls, run.reprefills + moved.reprefills

    async def _reprefill(self, run: _Run) -> _Prefilled:
        """Recompute the prompt's KV for a new staging. Its sampled token is discarded (the
        client already has the first token), so it is sampled greedily with ``max_tokens=2``:
        the prefill always ends in a handoff."""
        self.metrics.fallbacks.labels("handoff_reprefill").inc()
        run.reprefills += 1
        sampling = replace(run.req.sampling, max_tokens=2, min_tokens=0, temperature=0.0, ignore_eos=True,
                           stop_token_ids=())  # every field whose validity depends on max_tokens reset
        pre = await self._prefill_with_retry(run, sampling)
        if pre.handoff is None:
            raise BackendError("re-prefill ended without a handoff", 502, "server_error")
        return pre

    def _decode(self, run: _Run, worker_id: str, pre: _Prefilled, token_ids: list[int],
                num_generated: int) -> AsyncGenerator[GenerationChunk, None]:
        """One ``POST /decode`` stream (:func:`cpd.router.decode_relay.relay_decode`)."""
        req, w = run.req, self.workers.by_id[worker_id]
        assert pre.handoff is not None
        body = DecodeRequest(request_id=run.worker_request_id(), token_ids=token_ids, sampling=req.sampling,
                             handoff=pre.handoff, num_generated=num_generated, cache_salt=req.cache_salt,
                             fetch_timeout_s=self.timeouts.handoff_fetch_s(pre.answer.kv_bytes),
                             expect_boot_id=w.boot_id)
        return relay_decode(self.client, self.timeouts, self.metrics, w, self.decode_slots[w.worker_id], body,
                            pre.staging_deadline, pre.answer.kv_bytes)

    def _snapshots(self, excluded: set[str]) -> list:
        """Worker load snapshots with this request's excluded workers marked unhealthy."""
        return [replace(s, healthy=False) if s.worker_id in excluded else s for s in self.workers.snapshots()]

    def _correct_stale_index(self, d: RouteDecision, ans: PrefillAnswer, sent_s: float) -> None:
        """Bring the L3 view in line with what the worker found in the store (issue 7 §6): it
        reports, per probe or read, exactly which chunks were present and which were missing
        or corrupt, and only those change — valid chunks before or after a bad one stay, and
        chunks the index had lost are relearned. A plan that promised more L3 blocks than were
        loaded is counted as ``stale_index`` (docs/architecture.md).

        Chunks learned after a check (e.g. this request's own write-through, announced after
        its probe, possibly before this answer arrives) are newer than it and are spared. The
        check's moment on this clock is bounded from below by ``sent_s`` (when this request
        was sent, before the worker received it) plus the check's ``offset_s`` from that
        receipt, as the worker timed it; ``sent_s`` is a time before the POST."""
        for obs in ans.l3_observations:
            self.index.observe_l3(obs.block_hashes, list(obs.present), list(obs.gone), since=sent_s + obs.offset_s)
        plan = d.load_plan
        if plan.l3_blocks and ans.num_cached_tokens_by_tier.get(Tier.L3, 0) < plan.l3_blocks * self.cfg.block_size:
            self.metrics.fallbacks.labels("stale_index").inc()
