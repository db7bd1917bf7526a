"""One ``POST /decode`` stream, relayed: the decode worker's NDJSON lines
(:class:`cpd.messages.worker_api.DecodeLine`) become :class:`GenerationChunk` values.

Every wait is bounded (:class:`cpd.router.timeouts.DispatchTimeouts`): the decode slot until the
staging's deadline, the response headers, then each line (the worker sends a heartbeat line with
its engine's step count while the request waits in its queue) and the engine's progress (its step
count advancing within ``decode_stall_s``; a heartbeat that says the engine is stuck, or a 503
``engine_stuck`` refusal, ends the attempt at once): a worker whose engine thread is stuck under a
live event loop never holds a stream. What a retry can fix raises :class:`DecodeFailed` (the
worker failed in transport, time or progress: ``worker_failed``; the staging is gone:
``handoff_lost``, and its sender could not be reached from the decode worker:
``sender_unreachable``); the rest raises :class:`BackendError`.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import AsyncGenerator, Callable

import httpx

from cpd.messages.worker_api import (WORKER_RESTARTED, AppendRequest, DecodeLine, DecodeRequest, MalformedBody, decode_body, encode,
                                     error_code)
from cpd.router.metrics import RouterMetrics
from cpd.router.protocol import BackendError, GenerationChunk
from cpd.router.stream_lines import LineReader
from cpd.router.timeouts import WORKER_LINE_INTERVAL_S, DispatchTimeouts
from cpd.router.workers import WorkerInfo

JSON_HEADERS = {"content-type": "application/json"}


class DecodeFailed(Exception):
    """A decode attempt failed in a way a retry can fix: the worker failed (transport error,
    timeout, stuck or failed engine) or the staging is gone (``handoff_lost``: re-prefill)."""

    def __init__(self, msg: str, worker_failed: bool = False, handoff_lost: bool = False,
                 sender_unreachable: bool = False):
        super().__init__(msg)
        self.worker_failed, self.handoff_lost = worker_failed, handoff_lost
        self.sender_unreachable = sender_unreachable  # the decode worker could not fetch from the sender


async def relay_decode(client: httpx.AsyncClient, timeouts: DispatchTimeouts, metrics: RouterMetrics,
                       w: WorkerInfo, slots: asyncio.Semaphore, body: DecodeRequest | AppendRequest,
                       staging_deadline: float, kv_bytes: int, path: str = "/decode",
                       on_first_line: Callable[[DecodeLine], None] | None = None,
                       first_token_deadline: float | None = None) -> AsyncGenerator[GenerationChunk, None]:
    """Take a decode slot on ``w`` (waiting at most until ``staging_deadline``, router monotonic
    clock), send ``body`` to ``path`` (``/decode``, or ``/append`` for a decode-local append) and
    yield its tokens until the finish reason; ``on_first_line`` sees the first line first.
    ``first_token_deadline`` (router monotonic clock): the first line with tokens is due by then,
    heartbeats or not (an append's first token is a prefill: bounded by its estimate);
    :class:`DecodeFailed` otherwise, without ``worker_failed`` while the worker's heartbeats still
    come: it has not failed because an estimate was short (the caller reroutes the request, and
    keeps routing to the worker); with it when they stopped too (stopped, cut off)."""
    try:  # a free slot is taken at once; a wait for one ends before the staging's deadline
        await asyncio.wait_for(slots.acquire(), None if not slots.locked() else
                               max(0.0, staging_deadline - time.monotonic()))
    except asyncio.TimeoutError:
        metrics.fallbacks.labels("decode_slot_timeout").inc()
        raise BackendError(f"no decode slot on {w.worker_id} within the handoff staging's lifetime "
                           "(decode pool saturated)", 503, "service_unavailable", retry_after_s=1) from None
    w.running_requests += 1
    r = None
    try:
        first_byte_s = timeouts.decode_first_byte_s(kv_bytes)
        http_req = client.build_request("POST", f"{w.url}{path}", content=encode(body), headers=JSON_HEADERS,
                                        timeout=timeouts.httpx(max(first_byte_s, timeouts.decode_idle_s)))
        r = await asyncio.wait_for(client.send(http_req, stream=True), timeouts.connect_s + first_byte_s)
        if r.status_code != 200:
            await _decode_refused(metrics, w.worker_id, r)
        async with aclosing(_lines(r, timeouts, w.worker_id, on_first_line, first_token_deadline)) as chunks:
            async for chunk in chunks:
                yield chunk
                if chunk.finish_reason is not None:
                    return
    except (httpx.TransportError, asyncio.TimeoutError) as e:
        raise DecodeFailed(f"{type(e).__name__}: {e}", worker_failed=True) from e
    finally:
        w.running_requests -= 1
        slots.release()
        if r is not None:
            await r.aclose()


async def _lines(r: httpx.Response, timeouts: DispatchTimeouts, worker_id: str,
                 on_first_line: Callable[[DecodeLine], None] | None = None,
                 first_deadline: float | None = None) -> AsyncGenerator[GenerationChunk, None]:
    """The stream's lines as chunks, each wait bounded by :meth:`DispatchTimeouts.decode_deadline`
    (a line within ``decode_idle_s``, the engine's step count or the tokens advancing within
    ``decode_stall_s``), the first one with content by ``first_deadline`` (monotonic) when given.
    Heartbeats are skipped; one whose ``engine_stuck`` is set fails the stream at once."""
    lines = LineReader(r.aiter_lines())
    try:
        async for chunk in _chunks(lines, timeouts, worker_id, on_first_line, first_deadline):
            yield chunk
    finally:
        await lines.aclose()


async def _chunks(lines: LineReader, timeouts: DispatchTimeouts, worker_id: str,
                  on_first_line: Callable[[DecodeLine], None] | None,
                  first_deadline: float | None) -> AsyncGenerator[GenerationChunk, None]:
    first = True
    last_line_s = last_step_s = time.monotonic()
    steps: int | None = None

    def bound() -> tuple[float, str, bool]:
        """The first bound to end, why, and whether it is the estimate's (first-token) bound."""
        deadline_s, why = timeouts.decode_deadline(last_line_s, last_step_s)
        if first and first_deadline is not None and first_deadline < deadline_s:
            return first_deadline, "no first token within the bound", True
        return deadline_s, why, False

    def failed(why: str, too_slow: bool) -> DecodeFailed:
        """Past an estimate's bound, a worker still sending lines has not failed."""
        lines_hold = time.monotonic() - last_line_s < 3 * WORKER_LINE_INTERVAL_S
        return DecodeFailed(f"{worker_id}: {why}; engine steps seen: {steps}",
                            worker_failed=not (too_slow and lines_hold))

    while True:
        deadline_s, why, too_slow = bound()
        try:
            line = await lines.next(deadline_s)
        except StopAsyncIteration:
            raise DecodeFailed("stream ended without a finish_reason", worker_failed=True) from None
        if line is None:
            raise failed(why, too_slow)
        last_line_s = time.monotonic()
        msg = _parse_line(line, worker_id)
        if msg is None or msg.is_heartbeat:
            if msg is not None and msg.num_engine_steps != steps:
                steps, last_step_s = msg.num_engine_steps, last_line_s
            deadline_s, why, too_slow = bound()  # lines come, but the engine or the first token is late
            if time.monotonic() >= deadline_s:
                raise failed(why, too_slow)
            continue
        last_step_s = last_line_s
        if first and on_first_line is not None:
            on_first_line(msg)
        first = False
        yield GenerationChunk(token_ids=msg.token_ids, finish_reason=msg.finish_reason)


def _parse_line(line: str, worker_id: str) -> DecodeLine | None:
    """One line of the stream (None: an old worker's empty heartbeat, the idle bound only); an error
    line or a heartbeat that says the engine is stuck raises: :class:`DecodeFailed` when the
    worker failed (retry elsewhere), :class:`BackendError` when the request did."""
    if not line:
        return None
    try:
        msg = decode_body(line.encode(), DecodeLine)
    except MalformedBody as e:
        raise BackendError(f"decode worker {worker_id} sent a malformed line: {e}", 502, "server_error") from None
    if msg.error is not None and msg.engine_failed:  # its engine, not the request: retry elsewhere
        raise DecodeFailed(f"{worker_id}: its engine failed ({msg.error})", worker_failed=True)
    if msg.error is not None:
        raise BackendError(f"decode worker {worker_id}: {msg.error}", 502, "server_error")
    if msg.is_heartbeat and msg.engine_stuck:
        raise DecodeFailed(f"{worker_id}: its engine is stuck (a step past its bound; request "
                           f"{msg.request_state or 'unknown'})", worker_failed=True)
    return msg


async def _decode_refused(metrics: RouterMetrics, worker_id: str, r: httpx.Response) -> None:
    """A non-200 answer to ``POST /decode``: a lost staging or a stuck engine is retryable, the
    rest is not."""
    raw = await r.aread()
    text = raw[:300].decode(errors="replace")
    code = error_code(raw)
    if code in ("engine_stuck", WORKER_RESTARTED):  # the worker failed or restarted: exclude it, retry elsewhere
        metrics.fallbacks.labels(code).inc()
        raise DecodeFailed(f"decode worker {worker_id} refused ({r.status_code}): {text}", worker_failed=True)
    if r.status_code == 410 or code in ("handoff_stale", "handoff_unavailable"):
        unreachable = r.status_code != 410 and code == "handoff_unavailable"
        metrics.fallbacks.labels("handoff_unavailable" if unreachable else "handoff_stale").inc()
        raise DecodeFailed(f"handoff lost ({r.status_code}): {text}", handoff_lost=True,
                           sender_unreachable=unreachable)
    raise BackendError(f"decode worker {worker_id} error: {text}", 502, "server_error")
