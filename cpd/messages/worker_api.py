"""The router↔worker boundary: every body of the worker's internal HTTP API, typed.

Both sides go through these structures: the worker decodes its input with
:func:`decode_body` (a malformed body → 400 with msgspec's message, which names the field) and
encodes its answers with :func:`encode`; the router decodes the answers with
:func:`decode_body` too. JSON field names are the structures' field names.

=============================  ========================  ===================================
endpoint                       request body              answer
=============================  ========================  ===================================
``POST /prefill``              :class:`PrefillRequest`   :class:`PrefillResponse`; with
                                                         ``stream_progress``: NDJSON
                                                         :class:`PrefillLine` per line
``POST /decode``               :class:`DecodeRequest`    NDJSON :class:`DecodeLine` per line
                                                         (a heartbeat line: engine progress
                                                         only; old workers: an empty line)
``POST /append``               :class:`AppendRequest`    NDJSON :class:`DecodeLine` per line
                                                         (decode-local append; the first line
                                                         carries the prefix-cache figures)
``POST /role``                 :class:`RoleChangeRequest`  :class:`RoleChangeResponse`
``POST /handoff/release``      :class:`~cpd.messages.handoff.HandoffRelease`  :class:`Ack`
``GET /load``                  –                         :class:`LoadReport`
``GET /kv_snapshot``           –                         :class:`KvSnapshot`
``GET /l3_snapshot``           –                         :class:`L3Snapshot`
``GET /info``                  –                         :class:`WorkerInfoReport`
``POST /reset_prefix_cache``   –                         :class:`Ack`
any error                      –                         :class:`ErrorBody`
=============================  ========================  ===================================
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

from cpd.messages.handoff import HandoffHandle, HandoffRelease
from cpd.messages.sampling import SamplingParams
from cpd.types import BlockHash, Role, Tier

T = TypeVar("T")

ChunkKey = tuple[BlockHash, int]
"""An L3 chunk: ``(hash of its last block, number of blocks)``."""


class PrefillRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Run a prompt to its first token and stage its KV for handoff.

    ``max_l3_blocks``: load at most this many leading blocks from L3 (the policy chose to
    recompute the rest); None = as many as the store has. ``write_through``: also write every
    full prompt block to L3 (the pre-prefill pool). ``stream_progress``: answer as an NDJSON
    stream of :class:`PrefillLine` (progress lines while the prefill runs, then the answer), so
    that the caller can bound a prefill by its progress instead of a guess of its length."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    max_l3_blocks: int | None = None
    write_through: bool = False
    stream_progress: bool = False
    expect_boot_id: str | None = None  # the boot id the caller checked (GET /info); another: 409


class L3Observation(msgspec.Struct, frozen=True):
    """What one L3 store call saw (:class:`cpd.store.base.Observation`): for each hash in
    ``block_hashes``, the chunks ending at it are exactly ``present``; ``gone`` were found
    missing or corrupt. ``offset_s``: when the store was checked, in seconds after the worker
    received the prefill request whose answer carries this observation (negative: before it, as
    for a check made for an earlier request). The router adds it to the time it sent that
    request, which gives a lower bound on the check's moment on the router's own clock,
    whatever the two hosts' clocks say."""

    block_hashes: list[BlockHash]
    present: list[ChunkKey]
    gone: list[ChunkKey] = []
    offset_s: float = 0.0


class PrefillAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """Answer of ``POST /prefill`` (:data:`PrefillResponse`). The staged sequence is the prompt +
    ``first_token_ids``: the router holds the prompt, so the answer does not echo it (workers before
    issue 13 sent it as ``token_ids``, 0.7 MB for a 128K-token prompt; msgspec skips that unknown
    field without building it).

    ``finish_reason`` is None when the request continues on a decode worker (``handoff`` set,
    ``kv_bytes`` staged); else the first token ended it.
    ``num_cached_tokens_by_tier``: prompt tokens whose KV came from each tier. Times in seconds:
    ``prefill_s`` the whole call, ``queue_s`` waiting in the engine, ``compute_s`` the rest.
    ``fallback``: connector fallbacks by kind since the last answer; ``transfers``: per tier,
    ``(bytes, seconds)`` loaded since the last answer; ``l3_observations``: what the store showed.
    ``step_tokens`` / ``step_s``: tokens the engine computed in the steps that ran while this
    request was admitted (all requests of those steps together) and those steps' seconds: the
    engine's prefill rate unbiased by batching (:class:`cpd.engine.engine.StepOutput`)."""

    first_token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens_by_tier: dict[Tier, int] = {}
    prefill_s: float
    queue_s: float | None = None
    compute_s: float | None = None
    handoff: HandoffHandle | None = None
    kv_bytes: int = 0
    fallback: dict[str, int] = {}
    transfers: dict[Tier, tuple[int, float]] = {}
    l3_observations: list[L3Observation] = []
    step_tokens: int | None = None
    step_s: float | None = None

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.num_cached_tokens_by_tier.values())


PrefillResponse = PrefillAnswer  # the answer of ``POST /prefill``, as the worker sends it and the router reads it


RequestState = Literal["queued", "running", "held"]
"""A request's place in its worker's engine: queued (not yet admitted: waiting for the requests
ahead, or for KV blocks), running (admitted, computed each step it is scheduled), held (its
prefill is done, its KV kept for the handoff)."""


WORKER_RESTARTED = "worker_restarted"  # error code: not the process the caller checked (expect_boot_id); recheck it
ENGINE_FAILED = "engine_failed"  # error code: the worker's engine failed (not the request); retry elsewhere


class PrefillLine(msgspec.Struct, frozen=True, omit_defaults=True):
    """One NDJSON line of ``POST /prefill`` with ``stream_progress``: exactly one of

    * progress (``num_engine_steps``; sent every ``PREFILL_PROGRESS_S`` while the request is
      queued or computed): the worker's count of engine steps that ran a forward. It advances
      while this worker computes anything, this request or the ones queued before it; a worker
      whose count stops is stalled, one that sends no line is stopped or gone. With it
      ``engine_stuck`` (the worker's own verdict: its current step has run past its
      ``engine.max_step_s``) and ``request_state`` (:data:`RequestState`);
    * ``answer``: the prefill's answer (the last line);
    * ``error``: the request failed on the worker (the last line); with ``engine_failed`` the
      worker's engine failed it (its canary forward failed too), not the request: retry elsewhere."""

    num_engine_steps: int | None = None
    answer: PrefillAnswer | None = None
    error: str | None = None
    engine_failed: bool = False
    engine_stuck: bool = False
    request_state: RequestState | None = None


PrefillAnswerLine = PrefillLine  # the name the router reads a line by (it skipped the prompt's echo)


class DecodeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Fetch the staged KV named by ``handoff`` and continue decoding ``token_ids`` (prompt +
    the ``num_generated`` tokens already generated).

    ``fetch_timeout_s``: the caller's bound on the whole fetch (the router's, set below its own
    bound on this call's first byte): a sender that cannot deliver by then (stopped, partitioned,
    trickling) is answered 502 ``handoff_unavailable`` in time for the router to re-prefill,
    instead of the router timing out and blaming this worker. ``None``: the receiver's per-socket
    timeouts alone (old routers)."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    handoff: HandoffHandle
    num_generated: int = 1
    cache_salt: str | None = None
    fetch_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    expect_boot_id: str | None = None  # the boot id the caller checked (GET /info); another: 409


class AppendRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Decode-local append (issue 11 §4): generate ``prompt_token_ids`` to completion on this
    worker, one full-mode request (its cached prefix from L1/L2, the uncached suffix prefilled
    here, then decoded; no handoff). Answered like ``POST /decode``, as a stream."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    expect_boot_id: str | None = None  # the boot id the caller checked (GET /info); another: 409


class DecodeLine(msgspec.Struct, frozen=True, omit_defaults=True):
    """One NDJSON line of ``POST /decode`` or ``POST /append``: new tokens, the finish reason on
    the last one, or ``error`` (the request failed on the worker; with ``engine_failed`` its engine
    failed, not the request: retry elsewhere). The first line of an append
    also carries ``num_cached_tokens_by_tier`` (prompt tokens whose KV came from each tier) and
    ``queue_s`` (seconds the request waited in the engine).

    A heartbeat line (sent after ``DECODE_HEARTBEAT_S`` without output) has no tokens, no finish
    reason and no error, only the engine's progress, as a :class:`PrefillLine` progress line:
    ``num_engine_steps``, ``engine_stuck``, ``request_state``. The router bounds the stream by it
    (an engine whose step count stops, or that calls itself stuck, fails the stream), not by the
    heartbeats alone (an event loop outlives a stuck engine thread)."""

    token_ids: list[int] = []
    finish_reason: str | None = None
    error: str | None = None
    engine_failed: bool = False
    num_cached_tokens_by_tier: dict[Tier, int] | None = None
    queue_s: float | None = None
    num_engine_steps: int | None = None
    engine_stuck: bool = False
    request_state: RequestState | None = None

    @property
    def is_heartbeat(self) -> bool:
        return not self.token_ids and self.finish_reason is None and self.error is None and \
            self.num_engine_steps is not None


class RoleChangeRequest(msgspec.Struct, frozen=True):
    """Serve ``role`` from now on (elastic roles, issue 11 §3). Only between the prefill-side
    roles (pre-prefill ↔ prefill): a decode worker has no handoff sender and no L3 connector."""

    role: Role


class RoleChangeResponse(msgspec.Struct, frozen=True):
    """The change made (``from_role == to_role`` when the worker already had the role)."""

    worker_id: str
    from_role: Role
    to_role: Role


class WorkerHealth(msgspec.Struct, frozen=True):
    """The worker's own verdict (:class:`cpd.worker.runtime.StepHealth`)."""

    healthy: bool = True
    consecutive_failed_steps: int = 0
    num_failed_steps: int = 0  # steps the engine itself failed (a canary forward failed too)
    num_failed_requests: int = 0  # requests the engine finished with "error" (bad requests included)
    last_error: str | None = None
    stuck: bool = False  # the current engine step has run past engine.max_step_s (unhealthy)
    current_step_s: float = 0.0  # how long the current engine step has run (0: none running)


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """Answer of ``GET /load``: load figures the router routes by, plus accounting for
    operators and tests (``pool``: L1/L2 pool stats; ``handoff`` / ``handoff_received``: the
    handoff sender's and receiver's stats; ``fallbacks``: connector fallback counts;
    ``preemptions``: preemptions under KV-pool pressure, ``swapped`` / ``recomputed``)."""

    role: Role
    worker_id: str
    boot_id: str
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0
    pool: dict[str, Any] = {}
    handoff: dict[str, Any] | None = None
    handoff_received: dict[str, Any] | None = None
    fallbacks: dict[str, int] = {}
    preemptions: dict[str, int] = {}
    health: WorkerHealth = WorkerHealth()


class KvSnapshot(msgspec.Struct, frozen=True):
    """Answer of ``GET /kv_snapshot``: block hashes in L1 and L2 as of event sequence ``seq``."""

    seq: int
    l1: list[BlockHash]
    l2: list[BlockHash]


class L3Snapshot(msgspec.Struct, frozen=True):
    """Answer of ``GET /l3_snapshot``: every visible L3 chunk (a store listing)."""

    chunk_blocks: int
    chunks: list[ChunkKey]


class CostPrior(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a worker expects its own costs to be, in wall-clock units (a modeled worker's cost
    model × its time dilation K): the router prices with these until it has measured the same
    quantity (:meth:`cpd.router.estimates.CostEstimates.advertise`). ``None``: no expectation.

    - ``prefill_tokens_per_s``: the prefill scale of a full prefill step (the engine's token
      budget in prefill chunks, no cached prefix): tokens without attention context per second
      (:func:`cpd.policy.routing.prefill_scale_tokens_per_s` with ``attn_coeff``; plain prompt
      tokens per second when ``attn_coeff`` is None or 0), the quantity the router's rate EWMA
      samples.
    - ``attn_coeff``: the shape of prefill cost, a context token's attention cost relative to a
      token's linear cost (the architecture's, ``ModelShape.prefill_attn_coeff``); None: unknown
      (an old worker: the router keeps its own).
    - ``l2_bytes_per_s`` / ``l3_bytes_per_s``: KV load bandwidth from the host pool / the store.
    - ``source``: where the figures come from (e.g. ``roofline llama-3.1-70b h100 tp1, K=3``)."""

    prefill_tokens_per_s: float | None = None
    attn_coeff: float | None = None
    l2_bytes_per_s: float | None = None
    l3_bytes_per_s: float | None = None
    source: str = ""


class WorkerInfoReport(msgspec.Struct, frozen=True, kw_only=True):
    """Answer of ``GET /info`` (and the worker's ``READY`` line): identity and capacity.
    ``namespace``: the fields of :class:`cpd.kv.block_hash.Namespace`. ``cost_prior``: the
    worker's expected costs (:class:`CostPrior`); ``None`` when it has none (a torch worker)."""

    worker_id: str
    role: Role
    boot_id: str
    model_name: str = ""
    namespace: dict[str, Any]
    max_model_len: int
    kv_bytes_per_token: int
    cost_prior: CostPrior | None = None


class Ack(msgspec.Struct, frozen=True):
    ok: bool = True


class ErrorBody(msgspec.Struct, frozen=True, omit_defaults=True):
    """Any non-200 answer: ``code`` is machine-readable where the router acts on it
    (``handoff_stale`` 410, ``handoff_unavailable`` 502) or a caller may (409:
    ``role_change_refused``, ``wrong_role`` for an append on a worker that is not a decode worker,
    ``duplicate_request_id`` for the id of a request in flight on that worker)."""

    error: str
    code: str | None = None


class MalformedBody(ValueError):
    """A body that does not decode into its message type (the message names the field)."""


def decode_body(data: bytes, typ: type[T]) -> T:
    """Decode JSON ``data`` into ``typ``; :class:`MalformedBody` if it does not fit."""
    try:
        return msgspec.json.decode(data, type=typ)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise MalformedBody(f"{typ.__name__}: {e}") from None


def error_code(data: bytes) -> str | None:
    """The ``code`` of an :class:`ErrorBody` answer, or None (no code, or not an ErrorBody)."""
    try:
        return decode_body(data, ErrorBody).code
    except MalformedBody:
        return None


def encode(msg: Any) -> bytes:
    """JSON bytes of a message (enums as their values)."""
    return msgspec.json.encode(msg)


__all__ = ["PrefillRequest", "PrefillAnswer", "PrefillResponse", "PrefillLine", "PrefillAnswerLine", "L3Observation", "DecodeRequest", "DecodeLine", "AppendRequest",
           "RoleChangeRequest", "RoleChangeResponse", "LoadReport",
           "WorkerHealth", "KvSnapshot", "L3Snapshot", "WorkerInfoReport", "CostPrior", "Ack", "ErrorBody", "HandoffHandle",
           "HandoffRelease", "ChunkKey", "MalformedBody", "decode_body", "encode", "error_code"]
