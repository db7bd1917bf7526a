"""One ``POST /prefill``, streamed with progress (``PrefillRequest.stream_progress``): the worker
sends a :class:`cpd.messages.worker_api.PrefillLine` with its engine step count every 0.5 s, then
the answer. The call is bounded by progress (:meth:`cpd.router.timeouts.DispatchTimeouts.prefill_deadline`):
a prefill that keeps progressing runs to its end however long it is; a worker that stops sending
lines (SIGSTOP, crash, cut link) or whose engine stops stepping fails the call with
:class:`PrefillStalled` within the idle / stall bound, so the caller retries elsewhere; so does a
worker that says its engine is stuck (``engine_stuck`` on a progress line, or a 503
``engine_stuck`` refusal), at once, and one whose engine failed this request without the request
being at fault (an error line with ``engine_failed``, or a 503 ``engine_failed``: the engine's canary
forward failed too).
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

import httpx
import msgspec

from cpd.messages.worker_api import (ENGINE_FAILED, WORKER_RESTARTED, MalformedBody, PrefillAnswer, PrefillAnswerLine, PrefillRequest,
                                     decode_body, encode, error_code)
from cpd.router.protocol import BackendError
from cpd.router.stream_lines import LineReader
from cpd.router.timeouts import DispatchTimeouts

JSON_HEADERS = {"content-type": "application/json"}


class PrefillStalled(asyncio.TimeoutError):
    """The streamed prefill stopped progressing (or ran past the cap): the worker failed in time."""


async def post_prefill(client: httpx.AsyncClient, timeouts: DispatchTimeouts, url: str, worker_id: str,
                       body: PrefillRequest, on_running: Callable[[], None] | None = None) -> PrefillAnswer:
    """Send ``body`` (with ``stream_progress`` set) to ``url`` and return the answer line.
    ``on_running``: called for each progress line that reports the request running (or held:
    computed) on the worker, i.e. no longer queued there.

    Raises:
        PrefillStalled: no line within ``prefill_idle_s`` (headers included, plus ``connect_s``),
            no engine step within ``prefill_stall_s``, no answer within ``prefill_cap_s``, or the
            worker says its engine is stuck or failed.
        httpx.TransportError: connection refused or reset, or the stream ended without an answer.
        BackendError: 502 for a refusal (non-200), an error line or a malformed line."""
    sent_s = time.monotonic()
    body = _with_progress(body)
    headers_s = timeouts.connect_s + timeouts.prefill_idle_s
    # httpx's own read bound is a backstop only: the bounds below end first, with a clear reason
    req = client.build_request("POST", url, content=encode(body), headers=JSON_HEADERS,
                               timeout=timeouts.httpx(headers_s + 1.0))
    try:
        r = await asyncio.wait_for(client.send(req, stream=True), headers_s)
    except asyncio.TimeoutError:
        raise PrefillStalled(f"{worker_id}: no response headers within {headers_s:g} s "
                             "(stopped, dead or unreachable)") from None
    try:
        if r.status_code != 200:
            raw = await r.aread()
            if error_code(raw) in ("engine_stuck", ENGINE_FAILED, WORKER_RESTARTED):  # retried elsewhere
                raise PrefillStalled(f"{worker_id} refused: {raw[:200].decode(errors='replace')}")
            raise BackendError(f"prefill worker {worker_id} error: {raw[:200].decode(errors='replace')}", 502,
                               "server_error")
        return await _answer(r.aiter_lines(), timeouts, sent_s, worker_id, on_running)
    finally:
        await r.aclose()


def _with_progress(body: PrefillRequest) -> PrefillRequest:
    return body if body.stream_progress else msgspec.structs.replace(body, stream_progress=True)


async def _answer(lines: AsyncIterator[str], timeouts: DispatchTimeouts, sent_s: float,
                  worker_id: str, on_running: Callable[[], None] | None = None) -> PrefillAnswer:
    """Read progress lines until the answer line, each wait bounded by the progress so far."""
    reader = LineReader(lines)
    try:
        return await _read_answer(reader, timeouts, sent_s, worker_id, on_running)
    finally:
        await reader.aclose()


async def _read_answer(reader: LineReader, timeouts: DispatchTimeouts, sent_s: float, worker_id: str,
                       on_running: Callable[[], None] | None = None) -> PrefillAnswer:
    last_line_s = last_step_s = sent_s
    steps: int | None = None
    while True:
        deadline_s, why = timeouts.prefill_deadline(sent_s, last_line_s, last_step_s)
        try:
            line = await reader.next(deadline_s)
        except StopAsyncIteration:
            raise httpx.RemoteProtocolError(f"{worker_id}: prefill stream ended without an answer") from None
        if line is None:
            raise PrefillStalled(f"{worker_id}: {why}; engine steps seen: {steps}")
        last_line_s = time.monotonic()
        if not line:
            _check_progress(timeouts, sent_s, last_line_s, last_step_s, worker_id, steps)
            continue
        try:
            msg = decode_body(line.encode(), PrefillAnswerLine)  # the prompt echo (token_ids) skipped
        except MalformedBody as e:
            raise BackendError(f"prefill worker {worker_id} sent a malformed line: {e}", 502, "server_error") from None
        if msg.answer is not None:
            return msg.answer
        if msg.error is not None and msg.engine_failed:  # the worker's engine, not the request: retry elsewhere
            raise PrefillStalled(f"{worker_id}: its engine failed ({msg.error})")
        if msg.error is not None:
            raise BackendError(f"prefill worker {worker_id} error: {msg.error}", 502, "server_error")
        if msg.engine_stuck:
            raise PrefillStalled(f"{worker_id}: its engine is stuck (a step past its bound; request "
                                 f"{msg.request_state or 'unknown'}); engine steps seen: {msg.num_engine_steps}")
        if on_running is not None and msg.request_state in ("running", "held"):
            on_running()
        if msg.num_engine_steps != steps:
            steps, last_step_s = msg.num_engine_steps, last_line_s
        _check_progress(timeouts, sent_s, last_line_s, last_step_s, worker_id, steps)


def _check_progress(timeouts: DispatchTimeouts, sent_s: float, last_line_s: float, last_step_s: float,
                    worker_id: str, steps: int | None) -> None:
    """Lines come, but the engine stopped stepping or the cap has passed: :class:`PrefillStalled`.
    (The idle bound is judged by the reads, :class:`LineReader`.)"""
    deadline_s, why = timeouts.prefill_deadline(sent_s, last_line_s, last_step_s)
    if time.monotonic() >= deadline_s:
        raise PrefillStalled(f"{worker_id}: {why}; engine steps seen: {steps}")
