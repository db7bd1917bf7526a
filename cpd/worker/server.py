"""A worker process: one role, one engine, an internal HTTP API for the router.

Internal API (JSON; not OpenAI — only the router calls it). Every body is a typed message of
:mod:`cpd.messages.worker_api` (the table there maps endpoints to messages); a body that does not
decode into its message answers 400 ``{"error": "<message>: <what is wrong, at which field>"}``.

- ``POST /prefill`` (:class:`PrefillRequest` → :class:`PrefillResponse`): runs the prompt to its
  first token and stages the request's KV for handoff. If the caller disconnects first, the
  request is aborted and its blocks freed. With ``stream_progress`` the answer is NDJSON
  (:class:`PrefillLine`): a progress line (the engine's step count) every ``PREFILL_PROGRESS_S``
  until the answer line (or an error line), so that the router bounds a prefill by its progress,
  not by a guess of its length (:mod:`cpd.router.prefill_relay`).
- ``POST /decode`` (:class:`DecodeRequest` → NDJSON lines of :class:`DecodeLine`): fetches the KV
  (shared memory on one host, TCP otherwise) as a verified copy (the handle's generation and
  checksum, :mod:`cpd.worker.handoff`; within the router's ``fetch_timeout_s``), opens the stream,
  adds the KV to the engine (at the end of its current step), continues decoding and streams one
  line per output; a heartbeat line (the engine's step count, whether it is stuck, the request's
  state) is sent every ``DECODE_HEARTBEAT_S`` without output, so the router can bound the stream
  by the engine's progress without knowing how long this worker queues the request (heartbeats
  alone prove only that the event loop lives, not the engine thread). While the engine's current
  step has run past ``engine.max_step_s`` (stuck), ``/prefill``, ``/decode`` and ``/append``
  answer 503 ``{"code": "engine_stuck"}`` at once (a ``/decode`` still waiting to add its KV says
  so on its heartbeat line and ends: the staging is left to the router's retry) and ``/health``
  answers 503. A handle that no longer names its staging answers 410 ``{"error", "code":
  "handoff_stale"}``; an unreachable sender 502 ``{"code": "handoff_unavailable"}`` (the router
  re-prefills). Disconnect aborts.
- ``POST /append`` (:class:`AppendRequest` → NDJSON :class:`DecodeLine`): decode-local append
  (issue 11 §4): the whole generation on this worker as one full-mode request (cached prefix
  from L1/L2, the suffix prefilled here, then decoded); streamed like ``/decode`` (heartbeats
  included); the first line carries the prefix-cache figures. Disconnect aborts. Only a decode
  worker appends (409 ``wrong_role`` otherwise: the prefix a decode-local append reuses is a
  decode worker's).
- ``POST /role`` (:class:`RoleChangeRequest` → :class:`RoleChangeResponse`): change this
  worker's role at run time, between pre-prefill and prefill only (409 otherwise); requests
  in flight finish unchanged (a role only steers the router). Reported by ``/info``, ``/load``
  and the next registration.
- ``POST /handoff/release`` (:class:`HandoffRelease`) — frees that staging only.
- ``GET /info`` (:class:`WorkerInfoReport`), ``GET /load`` (:class:`LoadReport`), ``GET /health``,
  ``GET /kv_snapshot`` (:class:`KvSnapshot`), ``GET /l3_snapshot`` (:class:`L3Snapshot`),
  ``POST /reset_prefix_cache`` (:class:`Ack`).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, Callable

import httpx
import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from cpd.costmodel.prior import cost_prior
from cpd.engine.engine import loads_since
from cpd.messages.handoff import HandoffHandle, HandoffRelease
from cpd.messages.worker_api import (ENGINE_FAILED, WORKER_RESTARTED, Ack, AppendRequest, CostPrior, DecodeLine, DecodeRequest,
                                     ErrorBody, KvSnapshot, L3Observation, L3Snapshot, LoadReport, MalformedBody,
                                     PrefillLine, PrefillRequest, PrefillResponse, RoleChangeRequest,
                                     RoleChangeResponse, WorkerHealth, WorkerInfoReport, decode_body, encode)
from cpd.types import PREFILL_SIDE_ROLES, BlockHash, Role, Tier
from cpd.worker.ndjson_stream import NDJSONStream
from cpd.worker.runtime import DuplicateRequestId, EngineRunner, RequestFailed

log = logging.getLogger("cpd.worker")

def _reply(msg: Any, status_code: int = 200) -> Response:
    """A typed message as a JSON response."""
    return Response(encode(msg), status_code=status_code, media_type="application/json")


def _error(error: str, status_code: int, code: str | None = None) -> Response:
    return _reply(ErrorBody(error, code), status_code)


async def _read(request: Request, typ: type):
    """The request body decoded into ``typ``; :class:`MalformedBody` if it does not fit."""
    return decode_body(await request.body(), typ)


class WorkerState:
    """Everything one worker process holds."""

    def __init__(self, role: Role | str, worker_id: str, engine, runner: EngineRunner, handoff_sender, handoff_receiver,
                 publisher, connector=None):
        self.role = Role(role)
        self.worker_id = worker_id
        self.engine = engine
        self.runner = runner
        self.sender = handoff_sender
        self.receiver = handoff_receiver
        self.publisher = publisher
        self.connector = connector
        self.http = httpx.AsyncClient(timeout=10.0)
        self.boot_id = uuid.uuid4().hex  # tells the router this process restarted (it rechecks /info)
        self.model_name = ""
        self._fallbacks_reported: dict[str, int] = {}
        self._transfers_reported: dict[Tier, tuple[int, float]] = {}
        self.on_role_change: list[Callable[[Role], None]] = []  # e.g. the registrar's (cpd.worker.main)
        install_engine_thread_staging(self)

    def change_role(self, role: Role) -> RoleChangeResponse:
        """Serve ``role`` from now on (prefill-side roles only).

        Raises:
            ValueError: a change to or from ``decode`` (the handoff sender/receiver and the L3
                connector are made for one side at start)."""
        old = self.role
        if role != old and (old not in PREFILL_SIDE_ROLES or role not in PREFILL_SIDE_ROLES):
            raise ValueError(f"cannot change role {old} -> {role}: only pre-prefill <-> prefill")
        self.role = role
        if role != old:
            log.warning("worker %s role %s -> %s", self.worker_id, old, role)
            for cb in self.on_role_change:
                cb(role)
        return RoleChangeResponse(self.worker_id, old, role)

    def new_fallbacks(self) -> dict[str, int]:
        """Connector fallbacks (by kind) since the last call — the router sums them, so
        each one is reported exactly once (called on the event loop only)."""
        now = dict(getattr(self.connector, "fallback_counts", {}) or {})
        delta = {k: v - self._fallbacks_reported.get(k, 0) for k, v in now.items()}
        self._fallbacks_reported = now
        return {k: v for k, v in delta.items() if v > 0}

    def new_transfers(self) -> dict[Tier, tuple[int, float]]:
        """Bytes loaded and seconds spent per tier since the last call: ``{L2: (bytes, s),
        L3: (bytes, s)}`` (L2 = host-pool promotions, L3 = store loads), as the engine measures
        them: KV bytes of the served (or modeled) model over the whole load's time."""
        eng = self.engine
        now = {Tier.L2: (eng.l2_load_bytes, eng.l2_load_seconds)}
        if self.connector is not None:
            now[Tier.L3] = (eng.l3_load_bytes, eng.l3_load_seconds)
        out = loads_since(now, self._transfers_reported)
        self._transfers_reported = now
        return out


def worker_report(st: WorkerState) -> WorkerInfoReport:
    """Identity and capacity of this worker: the ``READY`` line and ``GET /info`` report it."""
    import dataclasses
    return WorkerInfoReport(worker_id=st.worker_id, role=st.role, boot_id=st.boot_id,
                            model_name=getattr(st, "model_name", ""),
                            namespace=dataclasses.asdict(st.engine.namespace),
                            max_model_len=st.engine.max_model_len, kv_bytes_per_token=st.engine.kv_bytes_per_token,
                            cost_prior=engine_cost_prior(st.engine, has_l3=st.connector is not None))


def engine_cost_prior(engine, has_l3: bool = True) -> CostPrior | None:
    """The costs ``engine`` expects (:func:`cpd.costmodel.prior.cost_prior`) when its executor
    times steps with a cost model (the modeled executor: ``cost_model`` × ``time_dilation``).
    An executor that runs a real model (torch) models no times, but its architecture gives the
    *shape* of its prefill cost: it advertises ``attn_coeff`` alone and the router measures the
    scale. None when neither is known. ``has_l3``: False drops the L3 bandwidth (a worker without
    a store never loads from it)."""
    executor = getattr(engine, "executor", None)
    cm = getattr(executor, "cost_model", None)
    if cm is None or not hasattr(cm, "step_time_s"):
        shape = getattr(executor, "model_shape", None)
        if shape is None:
            return None
        return CostPrior(attn_coeff=shape.prefill_attn_coeff, source=f"architecture {shape.name}")
    k = float(getattr(executor, "time_dilation", 1.0))
    sc = engine.scheduler_config
    what = [getattr(getattr(cm, a, None), "name", None) for a in ("model", "gpu")]
    source = " ".join([type(cm).__name__, *(w for w in what if w), f"tp={getattr(cm, 'tp', 1)}", f"K={k:g}"])
    prior = cost_prior(cm, time_dilation=k, max_num_batched_tokens=sc.max_num_batched_tokens,
                       max_prefill_chunk_tokens=sc.max_prefill_chunk_tokens, source=source)
    return prior if has_l3 else msgspec.structs.replace(prior, l3_bytes_per_s=None)


def worker_info(st: WorkerState) -> dict[str, Any]:
    """:func:`worker_report` as JSON-ready builtins (the ``READY`` line adds ports to it)."""
    return msgspec.to_builtins(worker_report(st))


DECODE_HEARTBEAT_S = 0.5  # an empty NDJSON line after this long without a decode output
PREFILL_PROGRESS_S = 0.5  # a progress line this often while a streamed prefill runs


async def _next_output(stream, request: Request, heartbeat_s: float | None = None):
    """Wait for the next engine output, aborting if the HTTP client went away. With
    ``heartbeat_s``, return None after that long without output (the caller sends a heartbeat)."""
    waited = 0.0
    while True:
        try:
            item = await asyncio.wait_for(stream.queue.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise ConnectionAbortedError from None
            waited += 0.25
            if heartbeat_s is not None and waited >= heartbeat_s:
                return None
            continue
        if isinstance(item, BaseException):
            raise RequestFailed(f"engine failed: {item!r}", engine_failed=getattr(item, "engine_failed", False))
        return item


def _progress_fields(st: WorkerState, rid: str) -> dict[str, Any]:
    """The engine's progress as a heartbeat or progress line carries it (:class:`DecodeLine`,
    :class:`PrefillLine`); read without the engine lock (a stuck step holds it)."""
    return {"num_engine_steps": st.engine.num_steps, "engine_stuck": st.runner.stuck(),
            "request_state": st.engine.request_state(rid)}


def _restarted_refusal(st: WorkerState, body) -> Response | None:
    """409 ``worker_restarted`` when the caller checked another process at this address (its
    ``expect_boot_id``): this one may serve other weights or settings (a worker restarted with
    another ``--model``) until the router has checked it; the router retries elsewhere and
    rechecks. None when it is this process, or the caller did not say."""
    want = body.expect_boot_id
    if want is None or want == st.boot_id:
        return None
    return _error(f"worker {st.worker_id} restarted (boot id {st.boot_id}; the caller checked {want}): "
                  "check GET /info again", 409, WORKER_RESTARTED)


def _stuck_refusal(st: WorkerState) -> Response | None:
    """503 ``engine_stuck`` while the engine's current step is stuck (new work would wait behind
    it without bound; the router retries elsewhere), else None."""
    return _stuck_error(st) if st.runner.stuck() else None


def _stuck_error(st: WorkerState) -> Response:
    return _error(f"worker {st.worker_id}: engine stuck (step running for {st.runner.current_step_s():.1f} s, "
                  f"bound {st.runner.max_step_s:g} s)", 503, "engine_stuck")


async def _caller_gone(request: Request, exc: Exception) -> Response:
    """The caller (the router) closed the connection while sending the body: it gave up on the call
    (its client left, or a bound expired). Nothing was started; no answer is read, so none is sent
    beyond a 499, and it is no server error."""
    log.debug("%s %s: the caller left while sending its body", request.method, request.url.path)
    return Response(status_code=499)


def build_app(st: WorkerState) -> FastAPI:
    app = FastAPI(title=f"cpd worker {st.worker_id}")
    app.add_exception_handler(ClientDisconnect, _caller_gone)

    @app.get("/health")
    async def health():
        """200 while the engine serves, 503 while its steps keep failing (current state, not
        a sticky last error: see :class:`cpd.worker.runtime.StepHealth`)."""
        h = st.runner.health()
        body = {"status": "ok" if h["healthy"] else "error", "role": st.role, "worker_id": st.worker_id, **h}
        return JSONResponse(body, status_code=200 if h["healthy"] else 503)

    @app.get("/info")
    async def info():
        """What the router checks before using this worker (:mod:`cpd.router.compat`): role, KV
        namespace, max_model_len, boot id (new at every process start)."""
        return _reply(worker_report(st))

    @app.get("/load")
    async def load():
        return _reply(load_report(st))

    @app.get("/kv_snapshot")
    async def kv_snapshot():
        def snapshot():
            with st.runner.engine_lock:
                snap = st.engine.cached_block_hashes()
                return snap, st.publisher.flush() if st.publisher else -1
        snap, seq = await asyncio.to_thread(snapshot)
        return _reply(KvSnapshot(seq=seq, l1=snap.get(Tier.L1, []), l2=snap.get(Tier.L2, [])))

    @app.get("/l3_snapshot")
    async def l3_snapshot():
        """Every visible L3 chunk ``[last_hash, n_blocks]`` (a store listing, for the router to
        rebuild its L3 view); 404 if this worker has no store, 503 if the store is unreachable."""
        return await _l3_snapshot(st)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        def reset():
            with st.runner.engine_lock:
                st.engine.reset_prefix_cache()
        await asyncio.to_thread(reset)
        return _reply(Ack())

    @app.post("/prefill")
    async def prefill(request: Request):
        try:
            body = await _read(request, PrefillRequest)
        except MalformedBody as e:
            return _error(f"bad prefill request: {e}", 400)
        return _restarted_refusal(st, body) or _stuck_refusal(st) or await _prefill(st, body, request)

    @app.post("/append")
    async def append(request: Request):
        try:
            body = await _read(request, AppendRequest)
        except MalformedBody as e:
            return _error(f"bad append request: {e}", 400)
        if st.role != Role.DECODE:
            return _error(f"decode-local append on a {st.role} worker: only decode workers append", 409,
                          "wrong_role")
        return _restarted_refusal(st, body) or _stuck_refusal(st) or _append(st, body, request)

    @app.post("/role")
    async def role(request: Request):
        try:
            body = await _read(request, RoleChangeRequest)
        except MalformedBody as e:
            return _error(f"bad role change: {e}", 400)
        try:
            return _reply(st.change_role(body.role))
        except ValueError as e:
            return _error(str(e), 409, "role_change_refused")

    @app.post("/handoff/release")
    async def release(request: Request):
        """Free one staging; with ``generation`` only if it is still that staging."""
        try:
            body = await _read(request, HandoffRelease)
        except MalformedBody as e:
            return _error(f"bad release request: {e}", 400)
        if st.sender is not None:
            st.sender.release(body.request_id, body.generation)
        return _reply(Ack())

    @app.post("/decode")
    async def decode(request: Request):
        try:
            body = await _read(request, DecodeRequest)
        except MalformedBody as e:
            return _error(f"bad decode request: {e}", 400)
        return _restarted_refusal(st, body) or _stuck_refusal(st) or await _decode(st, body, request)

    @app.on_event("startup")
    async def _warm_async_backend():
        """anyio imports its asyncio backend when the first streamed answer opens its task group
        (Starlette's ``StreamingResponse``): 0.03-0.1 s inside the first prefill. Done here, before
        the worker says it is ready."""
        import anyio
        async with anyio.create_task_group():
            pass

    reclaimer: list[asyncio.Task] = []

    @app.on_event("startup")
    async def _start_reclaimer():
        reclaimer.append(asyncio.create_task(_reclaim_loop(st)))

    @app.on_event("shutdown")
    async def _shutdown():
        for t in reclaimer:
            t.cancel()
        await st.http.aclose()

    return app


def load_report(st: WorkerState) -> LoadReport:
    """Load figures, pool accounting, handoff staging, fallback counts and health (``GET /load``)."""
    return LoadReport(role=st.role, worker_id=st.worker_id, boot_id=st.boot_id, **st.engine.load_stats(),
                      pool=st.engine.pool_stats(), handoff=st.sender.stats() if st.sender else None,
                      handoff_received=st.receiver.stats() if st.receiver else None,
                      fallbacks=dict(getattr(st.connector, "fallback_counts", {}) or {}),
                      preemptions=st.engine.preemption_stats(), health=msgspec.convert(st.runner.health(), WorkerHealth))


async def _prefill(st: WorkerState, body: PrefillRequest, request: Request):
    """Run the prompt to its first token and stage its KV. Whatever goes wrong after the
    request entered the engine (client gone, engine error, bug), it is aborted and its staged
    KV released, so no block outlives the call."""
    from cpd.engine.engine import EngineRequest
    rid = body.request_id
    t0 = time.monotonic()
    if st.sender is None:  # nothing to stage a handoff with: a decode worker (it appends, POST /append)
        return _error(f"prefill on a {st.role} worker: only prefill-side workers prefill", 409, "wrong_role")
    if st.sender.is_staged(rid):  # its staging would fail after the whole prefill, and its cleanup free the other's
        return _error(f"request id {rid!r} is already staged for a handoff on this worker", 409,
                      "duplicate_request_id")
    try:
        ereq = EngineRequest(request_id=rid, prompt_token_ids=body.prompt_token_ids, sampling=body.sampling,
                             cache_salt=body.cache_salt, mode="prefill", max_l3_blocks=body.max_l3_blocks,
                             write_through=body.write_through)
        stream = st.runner.submit(ereq)
    except DuplicateRequestId as e:
        return _error(str(e), 409, "duplicate_request_id")
    except (TypeError, ValueError) as e:
        return _error(f"bad prefill request: {e!r}", 400)
    if body.stream_progress:
        return NDJSONStream(_prefill_lines(st, rid, stream, request, t0), on_unstarted=lambda: _forsake(st, rid))
    try:
        return _reply(await _prefill_and_stage(st, rid, stream, request, t0))
    except RuntimeError as e:  # the engine failed this request (or itself: 503, retry elsewhere)
        _drop_prefill(st, rid)
        if getattr(e, "engine_failed", False):
            return _error(str(e), 503, ENGINE_FAILED)
        return _error(str(e), 500)
    except Exception as e:  # staging the handoff failed (or a bug): this request only, with its cause
        _drop_prefill(st, rid)
        log.exception("prefill %s failed", rid)
        return _error(f"prefill failed: {e!r}", 500, "prefill_failed")
    except BaseException:
        _drop_prefill(st, rid)
        raise
    finally:
        st.runner.close_stream(rid)


async def _reclaim_loop(st: WorkerState) -> None:
    """Free stagings nobody released once they are ``reclaim_after_s`` old, on a timer. The sender
    reclaimed only when it staged the next handoff, so on an idle worker a staging whose router
    died (or could not reach it) was held for good."""
    while True:
        sender = st.sender
        period_s = 1.0 if sender is None else min(1.0, sender.reclaim_after_s / 4)
        await asyncio.sleep(period_s)
        if sender is not None:
            sender.reclaim()


def _forsake(st: WorkerState, rid: str) -> None:
    """A streamed request whose caller went away before its stream began: abort it, release any
    staging of it, close its stream."""
    st.runner.abort(rid)
    if st.sender is not None:
        st.sender.release(rid)
    st.runner.close_stream(rid)


def _drop_prefill(st: WorkerState, rid: str) -> None:
    """Abort a prefill and release its staging (if any)."""
    st.runner.abort(rid)
    st.sender.release(rid)


async def _prefill_lines(st: WorkerState, rid: str, stream, request: Request, t0: float):
    """A streamed prefill (``stream_progress``): a :class:`PrefillLine` with the engine's step
    count every ``PREFILL_PROGRESS_S`` while it runs, then its answer (or an error) line. As in
    the plain call, whatever ends it early (client gone, engine error) aborts it and releases its
    staging."""
    task = asyncio.ensure_future(_prefill_and_stage(st, rid, stream, request, t0))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=PREFILL_PROGRESS_S)
            if not task.done():
                yield encode(PrefillLine(**_progress_fields(st, rid))) + b"\n"
        try:
            line = PrefillLine(answer=task.result())
        except RuntimeError as e:  # the engine failed this request (or itself: engine_failed)
            _drop_prefill(st, rid)
            line = PrefillLine(error=str(e), engine_failed=getattr(e, "engine_failed", False))
        except Exception as e:  # staging the handoff failed (or a bug): an error line, not a cut-off body
            _drop_prefill(st, rid)
            log.exception("prefill %s failed", rid)
            line = PrefillLine(error=f"prefill failed: {e!r}")
        yield encode(line) + b"\n"
    except BaseException:
        task.cancel()
        # a cancellation racing with the engine's answer can be lost (asyncio.wait_for before 3.12):
        # the task then fails later, its staging released below; nobody awaits it, so retrieve it here
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        _drop_prefill(st, rid)
        raise
    finally:
        st.runner.close_stream(rid)


async def _prefill_and_stage(st: WorkerState, rid: str, stream, request: Request, t0: float) -> PrefillResponse:
    out = await _next_output(stream, request)
    prefill_s = time.monotonic() - t0
    handoff = out.finish_reason == "handoff"
    resp = PrefillResponse(
        first_token_ids=list(out.new_token_ids), finish_reason=None if handoff else out.finish_reason,
        num_cached_tokens_by_tier={Tier(t): n for t, n in (out.num_cached_tokens_by_tier or {}).items()},
        prefill_s=prefill_s, queue_s=out.queue_s, compute_s=prefill_s - (out.queue_s or 0.0),
        fallback=st.new_fallbacks(), transfers=st.new_transfers(),
        l3_observations=_drain_l3_observations(st, t0), step_tokens=out.step_tokens, step_s=out.step_s)
    if not handoff:  # the first token already ended the request; the engine freed its blocks
        return resp

    # staged by the engine thread right after the step, before it delivered this output
    # (cpd.worker.runtime; a worker without a sender refuses /prefill, so the hook is installed)
    staged = st.runner.take_staged(rid)
    if staged is None:
        raise RuntimeError(f"request {rid}: its handoff was not staged by the engine thread")
    handle = await _staged(st, rid, asyncio.wrap_future(staged))
    if await request.is_disconnected():  # the router gave up meanwhile: nobody will fetch it
        st.sender.release(rid, handle.generation)
    handle = msgspec.structs.replace(handle, release_url=f"{_self_url(request)}/handoff/release")
    return msgspec.structs.replace(resp, handoff=handle, kv_bytes=int(handle.nbytes))


def stage_held(st: WorkerState, rid: str) -> HandoffHandle:
    """Stage the KV of the held request ``rid`` for its handoff and release it from the engine (the
    engine thread, under the engine lock): the KV is gathered straight into its staging area, one copy.
    Returns the staging's handle. (The staged sequence, prompt + first tokens, is not kept: the
    answer does not echo it, the router holds the prompt.)"""
    handle = st.sender.stage_into(rid, st.engine.export_kv_shape(rid), _kv_wire_dtype(st.engine),
                                  lambda out: st.engine.export_kv_into(rid, out))
    st.engine.release(rid)
    return handle


def install_engine_thread_staging(st: WorkerState) -> None:
    """Let the engine thread stage each handoff right after its step (cpd.worker.runtime)."""
    if st.sender is None:
        return
    st.runner.stage_handoff = lambda rid: stage_held(st, rid)
    st.runner.release_staged = lambda rid, handle: st.sender.release(rid, handle.generation)


async def _staged(st: WorkerState, rid: str, staging):
    """Await ``staging``, the engine thread's staging of ``rid`` (done, or about to be seen done by
    this loop). If the caller is cancelled meanwhile (client gone: its abort released ``rid``'s
    staging before this call saw the handle), the staging is released once it is seen done;
    else it would stay until the sender's reclaim."""
    fut = asyncio.ensure_future(staging)
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        def release(f: asyncio.Future) -> None:
            if not f.cancelled() and f.exception() is None:
                st.sender.release(rid, f.result().generation)
        fut.add_done_callback(release)
        raise


def _kv_wire_dtype(engine) -> np.dtype:
    """The numpy dtype the engine's KV travels as (bf16 as its raw bits, int16: numpy has no bf16)."""
    return engine.arrays.to_numpy(engine.arrays.zeros([1])).dtype


def _drain_l3_observations(st: WorkerState, received_s: float) -> list[L3Observation]:
    """What the L3 store showed since the last answer (router keeps its L3 view honest), each
    dated relative to ``received_s``, when this worker received the request being answered."""
    drain = getattr(st.connector, "drain_observations", None)
    if drain is None:
        return []
    dated = [dict(o, offset_s=o["checked_at_s"] - received_s) for o in drain()]  # checked_at_s is dropped
    return msgspec.convert(dated, list[L3Observation])


async def _l3_snapshot(st: WorkerState):
    store = getattr(st.connector, "store", None)
    if store is None:
        return _error("no L3 store", 404)
    from cpd.store import StoreUnavailable
    try:
        keys = await asyncio.to_thread(store.list_visible)
    except StoreUnavailable as e:
        return _error(f"L3 store unavailable: {e}", 503)
    return _reply(L3Snapshot(chunk_blocks=store.chunk_blocks, chunks=[(BlockHash(int(h)), int(n)) for h, n in keys]))


def _self_url(request: Request) -> str:
    return f"{request.url.scheme}://{request.url.netloc}"


async def _decode(st: WorkerState, body: DecodeRequest, request: Request):
    """Fetch the handoff as a verified private copy, then admit the request for decoding.

    A verified copy, not a zero-copy view of the sender's arena: the engine copies imported KV
    into its pool only when it has blocks for it, possibly long after this call, and by then the
    sender may have reclaimed and restaged the region. The copy is checked (generation before
    and after, checksum of the copy) before the engine ever sees it (issue 7 §1). Its cost is
    one extra memcpy plus one xxh3 pass (benchmarks/bench_handoff.py)."""
    from cpd.worker.handoff import HandoffStaleError
    rid = body.request_id
    handle = body.handoff
    if st.runner.in_flight(rid):  # never touch another request's stream (or its staging)
        return _error(f"request id {rid!r} is already in flight on this worker", 409, "duplicate_request_id")
    try:
        kv = await asyncio.to_thread(st.receiver.fetch, handle, None, body.fetch_timeout_s)
    except HandoffStaleError as e:  # released, reclaimed or restaged: never decode over it
        return _error(f"handoff stale: {e}", 410, "handoff_stale")
    except Exception as e:  # sender gone or bad handle: the router re-prefills elsewhere
        asyncio.create_task(_release(st, handle))
        return _error(f"handoff fetch failed: {e!r}", 502, "handoff_unavailable")
    try:
        stream = st.runner.open_stream(rid)
    except DuplicateRequestId as e:  # the same id arrived meanwhile
        return _error(str(e), 409, "duplicate_request_id")

    def add():  # the engine takes the numpy KV as its own kind of array (no torch in a modeled worker)
        with st.runner.engine_lock:
            st.engine.add_decode_request(rid, body.token_ids, kv, body.sampling,
                                         num_generated=body.num_generated, cache_salt=body.cache_salt)
    adding = asyncio.ensure_future(asyncio.to_thread(add))  # waits for the engine lock: a step's end
    return NDJSONStream(_admit_then_decode(st, rid, stream, request, handle, adding),  # caller gone: as a hang-up
                        on_unstarted=lambda: adding.add_done_callback(lambda f: _abandon(st, rid, f)))


async def _admit_then_decode(st: WorkerState, rid: str, stream, request: Request, handle: HandoffHandle,
                             adding: asyncio.Future):
    """The decode's NDJSON lines, opened as soon as the KV is fetched: while the KV waits to be added
    (for the engine lock, i.e. the end of the engine's current step, which may be long: an append's
    prefill chunk of the whole token budget), heartbeat lines with the engine's progress, so the
    router bounds the wait by progress (its step count advancing, or this worker's own
    ``engine_stuck`` verdict), not by a guess of one step's length: a healthy worker in a long step
    is no longer timed out and excluded. A stuck engine (its heartbeat says so, then the stream
    ends) or a caller gone: the add is abandoned (aborted once done) and the staging kept for a
    retry elsewhere; an add that fails (a request the engine refuses: ``ValueError``): an error
    line, the staging released. Then :func:`_decode_stream`."""
    admitted = False
    try:
        while not admitted:
            done, _ = await asyncio.wait({adding}, timeout=DECODE_HEARTBEAT_S)
            if done:
                admitted = True
            elif await request.is_disconnected():
                return
            else:
                progress = _progress_fields(st, rid)
                yield encode(DecodeLine(**progress)) + b"\n"
                if progress["engine_stuck"]:  # the caller retries elsewhere from the same staging
                    return
    finally:
        if not admitted:
            adding.add_done_callback(lambda f: _abandon(st, rid, f))
    try:
        adding.result()
    except Exception as e:  # ValueError: a request the engine refuses; anything else: a failed add
        st.runner.close_stream(rid)
        asyncio.create_task(_release(st, handle))
        what = "bad decode request" if isinstance(e, ValueError) else "decode admission failed"
        yield encode(DecodeLine(error=f"{what}: {e!r}")) + b"\n"
        return
    st.runner.wake()
    async with aclosing(_decode_stream(st, rid, stream, request, handle)) as lines:
        async for b in lines:
            yield b


def _abandon(st: WorkerState, rid: str, adding: asyncio.Future) -> None:
    """A decode given up while its KV was being added: once added, abort it (nobody reads it)."""
    if adding.cancelled() or adding.exception() is not None:
        st.runner.close_stream(rid)
    else:
        st.runner.abort(rid)


def _append(st: WorkerState, body: AppendRequest, request: Request) -> Response:
    """Decode-local append: submit one full-mode request and stream its outputs."""
    from cpd.engine.engine import EngineRequest
    rid = body.request_id
    try:
        stream = st.runner.submit(EngineRequest(request_id=rid, prompt_token_ids=body.prompt_token_ids,
                                                sampling=body.sampling, cache_salt=body.cache_salt, mode="full"))
    except DuplicateRequestId as e:
        return _error(str(e), 409, "duplicate_request_id")
    except (TypeError, ValueError) as e:
        return _error(f"bad append request: {e!r}", 400)
    return NDJSONStream(_append_stream(st, rid, stream, request), on_unstarted=lambda: _forsake(st, rid))


async def _append_stream(st: WorkerState, rid: str, stream, request: Request):
    """Relay an append's outputs as NDJSON (:func:`_ndjson_lines`); the first line carries the
    prefix-cache figures."""
    def first_line(out, line: DecodeLine) -> DecodeLine:
        by_tier = {Tier(t): n for t, n in (out.num_cached_tokens_by_tier or {}).items()}
        return msgspec.structs.replace(line, num_cached_tokens_by_tier=by_tier, queue_s=out.queue_s)
    async with aclosing(_ndjson_lines(st, rid, stream, request, first_line)) as lines:
        async for b in lines:  # closed with this generator: the abort runs at once on a disconnect
            yield b


async def _ndjson_lines(st: WorkerState, rid: str, stream, request: Request, first_line=None, on_first=None):
    """Engine outputs of ``rid`` as NDJSON lines, with a heartbeat line (the engine's progress,
    :func:`_progress_fields`) after each ``DECODE_HEARTBEAT_S`` without output; ``first_line``
    may rewrite the first line and ``on_first`` runs at the first output. Aborted (blocks freed)
    if it ends unfinished."""
    finished, first = False, True
    try:
        while not finished:
            out = await _next_output(stream, request, heartbeat_s=DECODE_HEARTBEAT_S)
            if out is None:
                yield encode(DecodeLine(**_progress_fields(st, rid))) + b"\n"
                continue
            finished = out.finished
            line = DecodeLine(token_ids=list(out.new_token_ids), finish_reason=out.finish_reason)
            if first:
                first = False
                if on_first is not None:
                    on_first()
                if first_line is not None:
                    line = first_line(out, line)
            yield encode(line) + b"\n"
    except RuntimeError as e:  # the engine failed this request (or itself: engine_failed)
        yield encode(DecodeLine(error=str(e), engine_failed=getattr(e, "engine_failed", False))) + b"\n"
    finally:
        if not finished:
            st.runner.abort(rid)
        st.runner.close_stream(rid)


async def _release(st: WorkerState, handle: HandoffHandle) -> None:
    """Release the sender's staging named by ``handle`` (that generation only)."""
    if handle.release_url is None:
        return  # the sender reclaims unreleased regions after a timeout
    try:
        await st.http.post(handle.release_url, content=encode(HandoffRelease(handle.request_id, handle.generation)),
                           headers={"content-type": "application/json"}, timeout=5.0)
    except httpx.HTTPError:
        pass  # the sender reclaims unreleased regions after a timeout


async def _decode_stream(st: WorkerState, rid: str, stream, request: Request, handle: HandoffHandle):
    """Relay engine outputs as NDJSON (:func:`_ndjson_lines`). The sender's staging is released at
    the first output (held until then so that the router can retry this decode on another worker
    from the same staging if this one fails before its first token) or when the request ends."""
    released = False

    def release() -> None:
        nonlocal released
        released = True
        asyncio.create_task(_release(st, handle))
    try:
        async with aclosing(_ndjson_lines(st, rid, stream, request, on_first=release)) as lines:
            async for b in lines:  # closed with this generator: the abort runs at once on a disconnect
                yield b
    finally:
        if not released:  # aborted before its first output
            asyncio.create_task(_release(st, handle))
