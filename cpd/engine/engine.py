"""The torch engine: model executor + scheduler + tiered KV (L1 pool, L2 host pool, L3 connector).

Request life cycle::

    add_request ─▶ inbox ─▶ waiting ─(prefix match L1 → L2 promote → L3 load)─▶ running
        running ─(chunked prefill, then one token per step)─▶ finished (blocks released)
        mode="prefill": after the first token ─▶ held (KV kept) ─ export_kv / release
        add_decode_request: KV imported into fresh blocks ─▶ running (decode)

Each :meth:`Engine.step` drains the inbox, prepares the head of the waiting queue
(prefix matching; blocks held only for this step unless admitted), asks the pure
:func:`cpd.engine.scheduler.schedule` for a plan, runs one model forward over all
scheduled tokens (prefill chunks and decodes together), registers newly full blocks
in the prefix cache, writes through to L3 if asked, samples and checks stops.

Failure isolation (one request never fails another): an exception attributable to one
request (its prefix load / KV import, its sampling) finishes only that request with
``finish_reason="error"``. An exception of the batched model forward is traced to the
requests that fail on their own by running parts of the step again (:mod:`cpd.engine.isolation`):
only those fail, the rest of the step runs. When nothing runs, a canary forward (:meth:`probe`)
tells a bad request (the canary runs: the engine is healthy) from a broken engine (it fails too:
a failed step, :attr:`last_step_error`). Blocks are freed either way and the engine keeps serving.

Threading: :meth:`add_request`, :meth:`add_decode_request`, :meth:`abort` and
:meth:`release` may be called from any thread; they enqueue a command that the
next :meth:`step` applies (or apply it at once, in the caller's thread, when no
step is running — so the ``event_sink`` may be called from either thread).
:meth:`step` must be called from one thread at a time. :meth:`export_kv` only
reads blocks that are pinned by the held request and may run concurrently with a step.
"""
from __future__ import annotations

import array
import collections
import logging
import operator
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from cpd.engine.connector import EventSink, KVConnector
from cpd.engine.executor import Executor, ForwardSeq, TokenHistory
from cpd.engine.faults import FaultPlan
from cpd.engine.host_pool import HostPool
from cpd.engine.isolation import isolate
from cpd.engine.kv_pool import KVPool, NoFreeBlocks
from cpd.engine.scheduler import SchedulePlan, SchedulerConfig, SeqState, blocks_for, schedule
from cpd.kv.block_hash import Namespace, hash_blocks, hash_blocks_u32le
from cpd.messages.sampling import SamplingParams

if TYPE_CHECKING:  # the torch executor imports torch; a modeled engine never does
    import torch

log = logging.getLogger(__name__)

MODES = ("full", "prefill", "decode")
DEFAULT_SWAP_SPACE_BYTES = 4 << 30  # vLLM's default swap space per GPU
TIERS = ("L1", "L2", "L3")


def loads_since(now: dict, reported: dict) -> dict:
    """The tier loads since the last report: ``{tier: (bytes, s)}`` of each tier in ``now`` (the
    engine's running totals, e.g. :attr:`Engine.l2_load_bytes` with its seconds) that loaded more
    bytes than in ``reported`` (the totals at the last report), as differences. The worker's
    prefill answers and the simulator report them alike."""
    out = {}
    for tier, (b, t) in now.items():
        b0, t0 = reported.get(tier, (0, 0.0))
        if b > b0:
            out[tier] = (b - b0, t - t0)
    return out


@dataclass
class EngineRequest:
    """A generation request.

    Attributes:
        request_id: unique among the engine's live requests.
        prompt_token_ids: prompt tokens (≥ 1, each in ``[0, vocab_size)``).
        sampling: sampling / stopping parameters.
        cache_salt: tenant salt mixed into the block-hash namespace (None = none).
        mode: ``"full"`` prefill + decode to completion; ``"prefill"`` stop after the first
            token and keep the KV for :meth:`Engine.export_kv` (finish_reason ``"handoff"``);
            ``"decode"`` here means "the handoff failed, recompute": it runs like ``"full"``
            (imported KV goes through :meth:`Engine.add_decode_request`).
        max_l3_blocks: most prefix blocks that may be loaded from L3 (None = any, 0 = none).
        write_through: save each computed full prompt block to L3 via ``connector.save``.
        block_hashes: the chained hashes of the prompt's leading full blocks, as
            :func:`cpd.kv.block_hash.hash_blocks` computes them under this engine's namespace
            with ``cache_salt`` (e.g. the router's, in one process); the engine uses them
            instead of hashing the prompt again. Trusted, not checked: only for callers that
            computed them with ``cpd.kv.block_hash`` (None = the engine hashes).
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    mode: str = "full"
    max_l3_blocks: int | None = None
    write_through: bool = False
    block_hashes: Sequence[int] | None = None


@dataclass
class StepOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens sampled this step (0 or 1).
        finished: no more output will come for this request.
        finish_reason: ``"stop"`` (stop/EOS token, included in the output), ``"length"``
            (max_tokens or max_model_len), ``"abort"``, ``"handoff"`` (prefill-mode request
            produced its first token; KV held until :meth:`Engine.release`), ``"error"``
            (this request failed inside a step — see :attr:`error`; its blocks are freed and
            the other requests go on), or None.
        num_cached_tokens_by_tier: on the request's first output only:
            ``{"L1": n, "L2": n, "L3": n}`` prompt tokens loaded instead of computed.
        queue_s: on the first output only: seconds from ``add_request`` to the step that
            first admitted the request (waiting time in this engine's queue).
        step_tokens / step_s: on the first output only: tokens the engine computed in its
            steps from the request's admission to this output, *all requests of those steps
            together*, and those steps' seconds (forward and sampling). A rate measured from
            them is the engine's, unbiased by batching: a request's own tokens over its own
            wall time would count its batch-mates' work as its own.
        error: with finish_reason ``"error"``: what failed (``repr`` of the exception).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    num_cached_tokens_by_tier: dict[str, int] | None = None
    queue_s: float | None = None
    error: str | None = None
    engine_failed: bool = False  # with "error": the engine failed (its canary too), not this request
    step_tokens: int | None = None
    step_s: float | None = None


class _Req:
    __slots__ = ("id", "sampling", "mode", "max_l3_blocks", "write_through", "ns", "prompt_len", "tokens",
                 "num_output", "blocks", "num_computed", "hashes", "num_registered", "prepared",
                 "cached_by_tier", "loaded_tier", "sent_first", "import_kv", "l3_next", "stop_ids",
                 "added_at_s", "admitted_at_s", "u32", "step_totals_at_admit", "swapped")

    def __init__(self, rid: str, tokens: list[int], prompt_len: int, sampling: SamplingParams, mode: str,
                 ns: Namespace, max_l3_blocks: int | None, write_through: bool, stop_ids: frozenset[int],
                 u32: bytes = b""):
        self.id = rid
        self.u32 = u32  # u32le bytes of the validated leading tokens (hashed without converting again)
        self.sampling = sampling
        self.mode = mode
        self.max_l3_blocks = max_l3_blocks
        self.write_through = write_through
        self.ns = ns
        self.prompt_len = prompt_len
        self.tokens = tokens
        self.num_output = len(tokens) - prompt_len
        self.blocks: list[int] = []
        self.num_computed = 0
        self.hashes: list[int] = []
        self.num_registered = 0
        self.prepared = False
        self.cached_by_tier = {t: 0 for t in TIERS}
        self.loaded_tier: dict[int, str] = {}
        self.sent_first = False
        self.import_kv: torch.Tensor | None = None
        self.l3_next: int | None = None
        self.stop_ids = stop_ids
        self.added_at_s = 0.0  # set by the engine, on its clock
        self.admitted_at_s: float | None = None
        self.step_totals_at_admit = (0, 0.0)  # the engine's (step_tokens_total, step_s_total) then
        self.swapped = False  # preempted with its KV swapped out: import_kv holds it until re-admission


class Engine:
    """Paged-KV LLM engine over a HF Llama directory.

    Args:
        model_dir: HF Llama directory (see :mod:`cpd.engine.weights`).
        num_blocks: L1 pool size in blocks.
        block_size: tokens per block (overrides ``scheduler_config.block_size``).
        host_kv_bytes: L2 host pool capacity in bytes (0 disables L2).
        scheduler_config: step limits (default ``SchedulerConfig()``).
        device: torch device ("cpu", "cuda", ...).
        dtype: model and KV dtype (float32 default).
        connector: L3 store client (None = no L3).
        event_sink: receives every KV event (L1 and L2).
        model_id: namespace model id (default: config ``cpd_model_id`` or the dir name).
        adapter_id: namespace adapter id.
        seed: seed of the engine RNG used by unseeded sampling.
        faults: test-only fault injection (:mod:`cpd.engine.faults`; default: none).
        clock: seconds for the queue times of the outputs (``queue_s``); the simulator passes
            its virtual clock.
        swap_space_bytes: host memory (modeled bytes, as ``host_kv_bytes``) for the KV of
            preempted requests (:meth:`_swap_out`); 0: preemption always recomputes.
        batch_invariant: the torch executor computes every row by calls of fixed shapes, so its
            tokens do not depend on chunking, batching or path (:mod:`cpd.engine.batch_invariant`).
    Raises:
        FileNotFoundError / KeyError / ValueError: bad model directory or sizes.
    """

    def __init__(self, model_dir: str | Path | None, *, num_blocks: int, block_size: int = 16, host_kv_bytes: int = 0,
                 scheduler_config: SchedulerConfig | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, connector: KVConnector | None = None,
                 event_sink: EventSink | None = None, model_id: str | None = None, adapter_id: str = "",
                 seed: int = 0, faults: FaultPlan | None = None, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic, swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES,
                 batch_invariant: bool = False):
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._clock = clock
        if executor is None:  # the default: real model math (cpd.engine.executor_torch)
            if model_dir is None:
                raise ValueError("Engine needs a model_dir, or an executor")
            from cpd.engine.executor_torch import TorchExecutor
            executor = TorchExecutor(model_dir, device=device, dtype=dtype, seed=seed, model_id=model_id,
                                     batch_invariant=batch_invariant)
        self.executor: Executor = executor
        self.model = getattr(executor, "model", None)
        self.device = getattr(executor, "device", None)
        self.dtype = getattr(executor, "dtype", None)
        self.config = executor.config
        self.arrays = executor.arrays
        lay = executor.kv_layout
        self.block_size = int(block_size)
        sc = scheduler_config or SchedulerConfig()
        self.scheduler_config = replace(sc, block_size=self.block_size)
        self.connector = connector
        self._sink = event_sink
        self.host_pool = HostPool(executor.payload_bytes(host_kv_bytes),
                                  (lay.num_layers, 2, self.block_size, lay.num_kv_heads, lay.head_dim),
                                  arrays=self.arrays, event_sink=event_sink,
                                  pin_memory=getattr(self.device, "type", "cpu") == "cuda")
        self.pool = KVPool(lay.num_layers, num_blocks, self.block_size, lay.num_kv_heads, lay.head_dim,
                           arrays=self.arrays, event_sink=event_sink, host_pool=self.host_pool)
        self._namespace = Namespace(
            model_id=model_id or executor.model_id, weights_digest=executor.weights_digest,
            tokenizer_digest=executor.tokenizer_digest, block_size=self.block_size,
            kv_dtype=executor.kv_dtype, adapter_id=adapter_id)
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []
        self._held: dict[str, _Req] = {}
        self._inbox: collections.deque = collections.deque()
        self._inbox_lock = threading.Lock()
        self._step_lock = threading.Lock()
        # Measured bandwidth per tier, for the router's estimates: modeled bytes (block_bytes)
        # over the time of the whole load, the executor's transfer wait included.
        self.l2_load_bytes = 0  # L2 -> L1 promotions
        self.l2_load_seconds = 0.0
        self.l3_load_bytes = 0  # L3 store -> L1 loads (lookup, read, copy-in, transfer)
        self.l3_load_seconds = 0.0
        self._live_ids: set[str] = set()
        self._pending_outputs: list[StepOutput] = []
        self._pending_prefill_tokens = 0
        self._load = {"queued_prefill_tokens": 0, "running_requests": 0, "waiting_requests": 0, "kv_usage": 0.0}
        self.num_steps = 0  # steps that ran a forward (a worker's progress counter)
        self.step_tokens_total = 0  # tokens computed by those steps, all requests together
        self.step_s_total = 0.0  # their seconds (forward and sampling), on ``clock``
        self.num_preemptions = 0
        self.swap_space_bytes = int(swap_space_bytes)  # modeled bytes, as host_kv_bytes
        self.num_swapped_preemptions = 0  # preemptions whose KV was swapped out (the rest recompute)
        self._faults = faults or FaultPlan()
        self.num_failed_requests = 0  # requests finished with "error"
        self.num_failed_steps = 0  # steps whose forward failed with the engine at fault (canary failed too)
        self.last_step_error: BaseException | None = None  # that error in the last step, else None

    # ------------------------------------------------------------------ properties
    @property
    def namespace(self) -> Namespace:
        """Block-hash namespace of this engine (no cache salt)."""
        return self._namespace

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V of one token over all layers (of the modeled model for a modeled executor)."""
        return self.executor.kv_bytes_per_token

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block (``kv_bytes_per_token * block_size``)."""
        return self.kv_bytes_per_token * self.block_size

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output tokens): min(config limit, L1 pool capacity)."""
        return min(self.config.max_position_embeddings, self.pool.num_blocks * self.block_size)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.config.eos_token_id

    # ------------------------------------------------------------------ public API (thread-safe)
    def _validate(self, rid: str, tokens: Sequence[int], sampling: SamplingParams) -> tuple[list[int], bytes]:
        """The prompt as a fresh list of ints and as u32le bytes (see :meth:`_check_ids`).

        Rules: every id is an integer (``operator.index``: ints, numpy / torch integers; a float,
        string or None is refused); at least one id; each in ``[0, vocab_size)``; shorter than
        ``max_model_len``; ``sampling`` is a :class:`SamplingParams`. Raises ValueError
        (TypeError for ``sampling``). A 1-D numpy integer array is checked and converted in C
        (:meth:`_array_ids`: one min/max, one ``tolist``), not id by id."""
        if isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
            toks, u32 = self._array_ids(tokens)
        else:
            try:
                toks = list(map(operator.index, tokens))  # exact ints
            except TypeError:
                raise ValueError("prompt_token_ids must be integers") from None
            if not toks:
                raise ValueError("prompt_token_ids must not be empty")
            u32 = self._check_ids(toks)
        if len(toks) >= self.max_model_len:
            raise ValueError(f"prompt of {len(toks)} tokens does not fit max_model_len={self.max_model_len}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be a SamplingParams")
        return toks, u32

    def _array_ids(self, ids: np.ndarray) -> tuple[list[int], bytes]:
        """:meth:`_validate`'s ids and u32le bytes of a 1-D numpy integer array (the same rules,
        the same errors as for a list: empty, or an id outside ``[0, vocab_size)``)."""
        if ids.size == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if (ids.dtype.kind == "i" and int(ids.min()) < 0) or int(ids.max()) >= min(self.vocab_size, 1 << 32):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        toks: list[int] = ids.tolist()
        return toks, ids.astype("<u4", copy=False).tobytes()

    def _check_ids(self, toks: list[int]) -> bytes:
        """u32le bytes of ``toks`` (a list of ints); ValueError unless every id is in
        ``[0, vocab_size)``. One C pass (``array("I")`` raises OverflowError for an id outside
        ``[0, 2**32)``) and a numpy max for the vocabulary bound; the bytes are what
        :func:`hash_blocks_u32le` hashes, so the prompt is not converted again for its hashes."""
        try:
            a = array.array("I", toks)
        except OverflowError:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})") from None
        ids = np.frombuffer(a, dtype=np.uint32)
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        return ids.astype("<u4", copy=False).tobytes()

    def _stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            ids.update(self.config.eos_token_ids)
        return frozenset(ids)

    def _submit(self, cmd: tuple, rid: str | None = None, new: bool = False, prefill_tokens: int = 0) -> None:
        with self._inbox_lock:
            if new:
                if rid is None:
                    raise ValueError("a new request needs its id")
                if rid in self._live_ids:
                    raise ValueError(f"duplicate request id {rid!r}")
                self._live_ids.add(rid)
                self._pending_prefill_tokens += prefill_tokens
            self._inbox.append(cmd)
        if self._step_lock.acquire(blocking=False):  # idle: apply now
            try:
                self._drain_inbox()
            finally:
                self._step_lock.release()

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request (any thread).

        Raises:
            ValueError: empty / out-of-vocabulary / too long prompt, unknown mode, duplicate id.
        """
        if req.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        toks, u32 = self._validate(req.request_id, req.prompt_token_ids, req.sampling)
        r = _Req(req.request_id, toks, len(toks), req.sampling, req.mode, self._namespace.with_salt(req.cache_salt),
                 req.max_l3_blocks, req.write_through, self._stop_ids(req.sampling), u32)
        if req.block_hashes is not None:  # the caller's (see EngineRequest): not hashed again
            r.hashes = list(req.block_hashes[:len(toks) // self.block_size])
        r.added_at_s = self._clock()
        self._submit(("add", r), req.request_id, new=True, prefill_tokens=len(toks))

    def add_decode_request(self, request_id: str, token_ids: Sequence[int], kv: Any,
                           sampling: SamplingParams, num_generated: int = 1, cache_salt: str | None = None) -> None:
        """Continue a request whose KV was computed elsewhere (the handoff's receiving side).

        Args:
            request_id: unique id.
            token_ids: prompt + generated tokens so far (the last ``num_generated`` are outputs;
                they count towards ``sampling.max_tokens``).
            kv: ``[num_layers, 2, n, num_kv_heads, head_dim]`` KV of the first ``n`` tokens,
                ``n < len(token_ids)`` (normally ``n = len(token_ids) - 1``); any device / dtype.
            sampling: sampling parameters (same as on the prefill side).
            num_generated: outputs already in ``token_ids`` (≥ 1).
            cache_salt: the request's tenant salt (full prompt blocks are registered in L1 under it).
        Raises:
            ValueError: shape mismatch, bad tokens, or duplicate id.
        Where the blocks cannot be allocated the engine waits for free blocks; the KV is then
        copied into fresh blocks and decoding continues exactly as on one engine.
        """
        toks, u32 = self._validate(request_id, token_ids, sampling)
        self._add_imported(request_id, toks, u32, kv, sampling, num_generated, cache_salt)

    def import_held(self, src: "Engine", request_id: str, sampling: SamplingParams | None = None) -> None:
        """Continue here a request that another engine of this process holds after its handoff
        (a ``"prefill"``-mode request finished with ``"handoff"``): ``src.export_kv`` then the
        same import as :meth:`add_decode_request` (same cache salt; ``sampling`` defaults to the
        held request's; the outputs so far count as generated). ``src`` keeps the request until
        its :meth:`release`.

        Validation: the token ids are ``src``'s own: its prompt was converted and checked by
        ``src``'s :meth:`add_request` (which kept their u32le bytes), the rest are sampled tokens
        (converted and checked here again). So the prompt is only range-checked against *this*
        engine's vocabulary (a numpy max over those bytes), not converted again; ids from outside
        an engine go through :meth:`add_decode_request`.

        Raises:
            TypeError: ``src`` is not an :class:`Engine` (or ``sampling`` not a
            :class:`SamplingParams`). KeyError: ``src`` does not hold
            ``request_id``. ValueError: ids outside this vocabulary, shape mismatch, duplicate id.
        """
        if not isinstance(src, Engine):
            raise TypeError("src must be an Engine")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be a SamplingParams")
        held = src._held[request_id]
        kv, toks = src.export_kv(request_id)
        n = len(held.u32) // 4  # the leading ids src validated, as u32le bytes
        ids = np.frombuffer(held.u32, dtype="<u4")
        if ids.size and int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        toks[n:] = map(operator.index, toks[n:])
        u32 = held.u32 + self._check_ids(toks[n:])
        if len(toks) >= self.max_model_len:
            raise ValueError(f"{len(toks)} tokens do not fit max_model_len={self.max_model_len}")
        self._add_imported(request_id, toks, u32, kv, sampling or held.sampling, len(toks) - held.prompt_len,
                           held.ns.cache_salt, held.hashes if held.ns == self._namespace.with_salt(held.ns.cache_salt)
                           else None)

    def _add_imported(self, request_id: str, toks: list[int], u32: bytes, kv: Any, sampling: SamplingParams,
                      num_generated: int, cache_salt: str | None, hashes: Sequence[int] | None = None) -> None:
        """Queue a request with imported KV (validated ids ``toks`` and their u32le bytes;
        ``hashes``: block hashes of their leading full blocks under this namespace, if known)."""
        if not 1 <= num_generated < len(toks):
            raise ValueError("num_generated must be in [1, len(token_ids))")
        lay = self.executor.kv_layout
        kv_t = self.arrays.as_array(kv)
        exp = (lay.num_layers, 2, lay.num_kv_heads, lay.head_dim)
        if len(kv_t.shape) != 5 or (kv_t.shape[0], kv_t.shape[1], kv_t.shape[3], kv_t.shape[4]) != exp \
                or not 0 < kv_t.shape[2] < len(toks):
            raise ValueError(f"kv shape {tuple(kv_t.shape)} does not match [L,2,n,H,D]={exp} with n < {len(toks)}")
        r = _Req(request_id, toks, len(toks) - num_generated, sampling, "full", self._namespace.with_salt(cache_salt),
                 0, False, self._stop_ids(sampling), u32)
        r.import_kv = kv_t
        if hashes is not None:  # the exporting engine's, same namespace (import_held): not hashed again
            r.hashes = list(hashes[:len(toks) // self.block_size])
        r.added_at_s = self._clock()
        self._submit(("add", r), request_id, new=True)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (at once if no step is running, else at the next
        step). A ``StepOutput(finished=True, finish_reason="abort")`` follows from :meth:`step`.
        Unknown / finished ids are ignored."""
        self._submit(("abort", request_id))

    def release(self, request_id: str) -> None:
        """Free the KV held by a finished ``"prefill"``-mode request (after :meth:`export_kv`)."""
        self._submit(("release", request_id))

    def export_kv(self, request_id: str) -> tuple[Any, list[int]]:
        """KV and tokens of a held ``"prefill"``-mode request (finish_reason ``"handoff"``).

        Returns:
            ``(kv, token_ids)``: ``kv`` is a contiguous CPU-or-device tensor
            ``[num_layers, 2, n, num_kv_heads, head_dim]`` for the ``n = len(token_ids) - 1``
            tokens whose KV exists; ``token_ids`` = prompt + first sampled token.
        Raises:
            KeyError: the request is not held.
        """
        r = self._held[request_id]
        return self.arrays.gather_tokens(self.pool.kv, r.blocks, r.num_computed), list(r.tokens)

    def export_kv_shape(self, request_id: str) -> tuple[int, int, int, int, int]:
        """``[num_layers, 2, n, num_kv_heads, head_dim]`` of :meth:`export_kv_into`'s KV (in
        elements of the engine's KV dtype; bytes = product × ``kv_bytes_per_token`` / per-token
        elements). Raises: KeyError: the request is not held."""
        r = self._held[request_id]
        L, two, _, _, H, D = self.pool.kv.shape
        return (L, two, r.num_computed, H, D)

    def export_kv_into(self, request_id: str, out: Any) -> list[int]:
        """Like :meth:`export_kv`, but the KV is written straight into ``out`` — a contiguous
        tensor or any writable buffer (numpy array, ``memoryview`` of shared memory) of exactly
        :meth:`export_kv_shape` elements of the KV dtype, i.e. ``n * kv_bytes_per_token``
        bytes — with one gather per layer and K/V (no intermediate copy).

        Returns:
            token ids (prompt + first sampled token).
        Raises:
            KeyError: the request is not held. ValueError/RuntimeError: ``out`` has the wrong size.
        """
        r = self._held[request_id]
        self.arrays.gather_tokens_into(self.pool.kv, r.blocks, r.num_computed, out)
        return list(r.tokens)

    def has_unfinished(self) -> bool:
        """True while any request is queued or running, or an output is still to be returned
        by :meth:`step` (e.g. the ``"abort"`` of a request aborted between steps); held
        prefill requests do not count."""
        return bool(self._inbox or self._waiting or self._running or self._pending_outputs)

    def request_state(self, request_id: str) -> str | None:
        """``"queued"`` (not yet admitted), ``"running"``, ``"held"`` (prefilled, KV kept for
        export) or None (unknown, finished). Read without the step lock, so that any thread may
        ask while a step runs (a stuck one too); the answer may be a step old."""
        if request_id in self._held:
            return "held"
        if any(r.id == request_id for r in list(self._running)):
            return "running"
        return "queued" if request_id in self._live_ids else None

    def load_stats(self) -> dict:
        """``queued_prefill_tokens`` (prompt tokens not yet computed, queued or running),
        ``running_requests``, ``waiting_requests``, ``kv_usage`` (fraction of L1 blocks in use),
        as of the last step (plus requests added since)."""
        d = dict(self._load)
        d["queued_prefill_tokens"] += self._pending_prefill_tokens
        return d

    def preemption_stats(self) -> dict[str, int]:
        """Preemptions under KV-pool pressure so far: ``swapped`` (KV copied out and back,
        :meth:`_swap_out`) and ``recomputed`` (past ``swap_space_bytes``: re-prefilled)."""
        return {"swapped": self.num_swapped_preemptions,
                "recomputed": self.num_preemptions - self.num_swapped_preemptions}

    def pool_stats(self) -> dict:
        """L1 :meth:`KVPool.stats` plus ``l2_*`` host pool stats."""
        d = self.pool.stats()
        d.update({f"l2_{k}": v for k, v in self.host_pool.stats().items()})
        return d

    def cached_block_hashes(self) -> dict[str, list[int]]:
        """Block hashes cached per tier, ``{"L1": [...], "L2": [...]}`` — the snapshot a
        router resynchronises its prefix index from after an event gap."""
        with self._step_lock:
            return {"L1": list(self.pool.cached), "L2": self.host_pool.hashes()}

    def check_invariants(self) -> None:
        """Raises ``AssertionError`` if pool bookkeeping disagrees with the requests' blocks."""
        with self._step_lock:
            self.pool.check_invariants()
            refs = [0] * self.pool.num_blocks
            for r in list(self._waiting) + self._running + list(self._held.values()):
                for b in r.blocks:
                    refs[b] += 1
            assert refs == self.pool.ref, "pool ref counts disagree with requests' block tables"

    def reset_prefix_cache(self) -> None:
        """Drop all cached (L1 and L2) blocks; emits ``AllBlocksCleared``."""
        with self._step_lock:
            self._drain_inbox()
            self.pool.reset_prefix_cache()
            for r in list(self._waiting) + self._running + list(self._held.values()):
                r.num_registered = r.num_computed // self.block_size  # don't re-register

    def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None,
                 **request_kwargs) -> list[int]:
        """Run one request to completion and return its output tokens (for tests / oracle;
        outputs of other requests stepped meanwhile are dropped)."""
        rid = f"gen-{uuid.uuid4().hex}"
        self.add_request(EngineRequest(rid, list(prompt_token_ids), sampling or SamplingParams(), **request_kwargs))
        out: list[int] = []
        while True:
            for o in self.step():
                if o.request_id == rid:
                    out.extend(o.new_token_ids)
                    if o.finished:
                        if o.finish_reason == "handoff":
                            self.release(rid)
                        return out

    # ------------------------------------------------------------------ inbox
    def _drain_inbox(self) -> None:
        while True:
            with self._inbox_lock:
                if not self._inbox:
                    return
                cmd = self._inbox.popleft()
                if cmd[0] == "add" and cmd[1].import_kv is None:
                    self._pending_prefill_tokens -= cmd[1].prompt_len
            kind = cmd[0]
            if kind == "add":
                self._waiting.append(cmd[1])
            elif kind == "abort":
                self._do_abort(cmd[1])
            elif kind == "release":
                r = self._held.pop(cmd[1], None)
                if r is not None:
                    self._free(r)
        self._update_load()

    def _forget(self, rid: str) -> None:
        with self._inbox_lock:
            self._live_ids.discard(rid)

    def _free(self, r: _Req) -> None:
        if r.blocks:
            self.pool.release(r.blocks)
        r.blocks = []
        r.num_computed = 0
        r.prepared = False
        self._forget(r.id)

    def _do_abort(self, rid: str) -> None:
        for q in (self._waiting, self._running):
            for r in q:
                if r.id == rid:
                    q.remove(r)
                    self._free(r)
                    self._pending_outputs.append(StepOutput(rid, [], True, "abort"))
                    return
        held = self._held.pop(rid, None)
        if held is not None:
            self._free(held)

    def _update_load(self) -> None:
        q = 0
        for queue in (self._waiting, self._running):
            for r in queue:
                done = r.import_kv.shape[2] if r.swapped and r.import_kv is not None else r.num_computed
                if (r.import_kv is None or r.swapped) and r.prompt_len > done:
                    q += r.prompt_len - done
        pool = self.pool
        self._load = {"queued_prefill_tokens": q, "running_requests": len(self._running),
                      "waiting_requests": len(self._waiting),
                      "kv_usage": (pool.num_blocks - pool.num_free_blocks()) / pool.num_blocks}

    # ------------------------------------------------------------------ prefix matching / loading
    def _ensure_hashes(self, r: _Req, upto_blocks: int) -> None:
        have = len(r.hashes)
        if have >= upto_blocks:
            return
        bs = self.block_size
        parent = r.hashes[-1] if r.hashes else None
        a, b = 4 * have * bs, 4 * upto_blocks * bs
        if b <= len(r.u32):  # validated ids: their u32le bytes are at hand
            r.hashes.extend(hash_blocks_u32le(memoryview(r.u32)[a:b], r.ns, parent_hash=parent))
        else:
            r.hashes.extend(hash_blocks(r.tokens[have * bs:upto_blocks * bs], r.ns, parent_hash=parent))

    def _register_full(self, r: _Req) -> None:
        """Register the request's computed full blocks not yet in the prefix cache."""
        bs = self.block_size
        n_full = r.num_computed // bs
        if r.num_registered >= n_full:
            return
        self._ensure_hashes(r, n_full)
        k = r.num_registered
        self.pool.register_run(r.blocks[k:n_full], r.hashes[k:n_full], r.hashes[k - 1] if k else None,
                               r.tokens[k * bs:n_full * bs])
        r.num_registered = n_full

    def _copy_in(self, blocks: Sequence[int], data: Sequence) -> None:
        """Copy block arrays ``data`` (the block layout, as :meth:`_l3_fetch` checks) into pool
        blocks ``blocks``: numpy blocks of one dtype as one ``[L, 2, n, H, D]`` array and one
        scatter per layer and K/V (:meth:`KVArrays.scatter_tokens`), else block by block."""
        first = data[0] if len(data) > 1 else None
        if first is not None and all(type(d) is np.ndarray and d.dtype == first.dtype for d in data):
            self.arrays.scatter_tokens(self.pool.kv, blocks, np.concatenate(data, axis=2))
            return
        for b, d in zip(blocks, data):
            self.arrays.copy_into(self.pool.block_view(b), d)

    def _prepare(self, r: _Req, reserve: int) -> bool:
        """Match / load the longest cached prefix of a waiting request and hold its blocks,
        allocating at most ``num_free_blocks() - reserve`` new blocks for loads: L1 hits first,
        then L2 promotions, then L3 loads, each continuing where the previous tier stopped (the
        order the router's index predicts). Returns False if an imported KV could not get
        blocks (try again later)."""
        max_blocks = (len(r.tokens) - 1) // self.block_size  # always compute at least the last token
        self._ensure_hashes(r, max_blocks)
        hashes = r.hashes[:max_blocks]
        if r.import_kv is not None:
            return self._prepare_import(r, hashes, reserve)
        hit = self.pool.match(hashes)
        self.pool.acquire(hit)
        r.blocks = list(hit)
        k = len(hit)
        budget = self.pool.num_free_blocks() - reserve
        if self.host_pool.enabled and k < max_blocks and budget > 0:
            m = self._promote_l2(r, hashes, k, min(self.host_pool.match(hashes[k:max_blocks]), budget))
            k, budget = k + m, budget - m
        if self.connector is not None and k < max_blocks and budget > 0:
            k += self._load_l3(r, hashes, k, self._l3_limit(r, min(max_blocks - k, budget)))
        self._finish_prepare(r, hashes, k)
        return True

    def _prepare_import(self, r: _Req, hashes: list[int], reserve: int) -> bool:
        """A handed-off request: reuse the L1 blocks it shares, copy the rest of its imported KV
        into fresh blocks. False if the blocks are not free yet."""
        bs = self.block_size
        assert r.import_kv is not None
        n_kv = r.import_kv.shape[2]
        hit = self.pool.match(hashes[:n_kv // bs])
        self.pool.acquire(hit)
        need = blocks_for(n_kv, bs) - len(hit)
        if need > self.pool.num_free_blocks() - reserve:
            self.pool.release(hit)
            return False
        new = self.pool.allocate(need)
        r.blocks = list(hit) + new
        start = len(hit) * bs
        self.arrays.scatter_tokens(self.pool.kv, new, r.import_kv[:, :, start:n_kv])
        self.executor.transfer("L2" if r.swapped else "NIC", n_kv - start)  # a swap-in crosses the host link
        r.num_computed = n_kv
        r.num_registered = len(hit)
        self._register_full(r)
        if not r.swapped:  # a swapped request keeps what its first admission found cached
            r.cached_by_tier = {"L1": len(hit) * bs, "L2": 0, "L3": 0}
        r.prepared = True
        return True

    def _register_loaded(self, r: _Req, hashes: list[int], k: int, blocks: Sequence[int], tier: str) -> None:
        """Register ``blocks`` (just filled from ``tier``) as the request's blocks ``k, k+1, ...``."""
        bs = self.block_size
        e = k + len(blocks)
        self.pool.register_run(blocks, hashes[k:e], hashes[k - 1] if k else None, r.tokens[k * bs:e * bs])
        for h in hashes[k:e]:
            r.loaded_tier.setdefault(h, tier)

    def _promote_l2(self, r: _Req, hashes: list[int], k: int, m: int) -> int:
        """Copy up to ``m`` blocks from the L2 host pool into fresh L1 blocks after the first ``k``;
        returns how many were promoted (a block evicted meanwhile ends the run)."""
        if m <= 0:
            return 0
        for h in hashes[k:k + m]:
            self.host_pool.touch(h)  # mark MRU so our own L1 evictions don't push them out
        new = self.pool.allocate(m)
        r.blocks.extend(new)  # owned at once: a failure below releases them with the request
        m2 = self.host_pool.match(hashes[k:k + m])
        t0 = time.perf_counter()
        for j in range(m2):
            self.arrays.copy_into(self.pool.block_view(new[j]), self.host_pool.get(hashes[k + j]))
        self._register_loaded(r, hashes, k, new[:m2], "L2")
        self.executor.transfer("L2", m2 * self.block_size)
        self.l2_load_seconds += time.perf_counter() - t0
        self.l2_load_bytes += m2 * self.block_bytes
        if m2 < m:
            self.pool.release(new[m2:])
            del r.blocks[len(r.blocks) - (m - m2):]
        return m2

    def _l3_limit(self, r: _Req, limit: int) -> int:
        """At most ``limit`` blocks, and no more than the request's own L3 allowance (the router's
        load-vs-recompute plan)."""
        if r.max_l3_blocks is not None:
            used = sum(1 for t in r.loaded_tier.values() if t == "L3")
            limit = min(limit, max(0, r.max_l3_blocks - used))
        return limit

    def _load_l3(self, r: _Req, hashes: list[int], k: int, limit: int) -> int:
        """Load up to ``limit`` blocks after the first ``k`` from the L3 store into fresh L1
        blocks; returns how many were loaded. Every store fault is a miss (recompute)."""
        t0 = time.perf_counter()
        arrays = self._l3_fetch(hashes[k:k + limit]) if limit > 0 else None
        if not arrays:
            return 0
        new = self.pool.allocate(len(arrays))
        try:
            self._copy_in(new, arrays)
        except Exception:  # undecodable payload: a miss, like any store fault
            log.warning("L3 blocks could not be copied in; recomputing", exc_info=True)
            self.pool.release(new)
            return 0
        self.executor.transfer("L3", len(new) * self.block_size)
        self.l3_load_seconds += time.perf_counter() - t0
        self.l3_load_bytes += len(new) * self.block_bytes
        self._register_loaded(r, hashes, k, new, "L3")
        r.blocks.extend(new)
        return len(new)

    def _l3_fetch(self, want: list[int]) -> list | None:
        """The leading blocks of ``want`` that the store holds, as block arrays; None on any fault
        or malformed answer (docs/architecture.md, fallbacks)."""
        assert self.connector is not None
        try:
            n = min(int(self.connector.lookup(want)), len(want))
        except Exception:
            log.warning("L3 lookup failed; recomputing", exc_info=True)
            return None
        if n <= 0:
            return None
        try:
            arrays = self.connector.load(want[:n])
        except Exception:
            log.warning("L3 load failed; recomputing", exc_info=True)
            return None
        if arrays is None:  # gone since the lookup (evicted) or unreadable (the connector counts corrupt reads)
            log.debug("L3 blocks missing or corrupt since the lookup; recomputing")
            return None
        exp = tuple(self.pool.block_view(0).shape)
        if len(arrays) != n or any(tuple(np.shape(a)) != exp for a in arrays):
            log.warning("L3 returned malformed blocks; recomputing")
            return None
        return list(arrays)

    def _finish_prepare(self, r: _Req, hashes: list[int], k: int) -> None:
        """The first ``k`` blocks are cached: count them per tier they came from."""
        bs = self.block_size
        r.num_computed = k * bs
        r.num_registered = k
        tiers = {t: 0 for t in TIERS}
        for h in hashes[:k]:
            tiers[r.loaded_tier.get(h, "L1")] += bs
        r.cached_by_tier = tiers
        r.prepared = True

    def _swap_out(self, r: _Req) -> None:
        """Preemption by swapping (vLLM's swap space): copy a victim's computed KV out of the pool
        before its blocks are freed; on re-admission it is copied back exactly as computed (the
        import path of a handoff, :meth:`_prepare_import`) instead of being recomputed by a
        prefill, whose KV of the tokens first computed one decode step at a time need not be
        bit-identical in low precision (bf16: a greedy token flipped). Only while the swapped KV
        of every waiting request stays within ``swap_space_bytes`` (modeled bytes, as
        ``host_kv_bytes``); past it the victim is recomputed (the old rule)."""
        n = r.num_computed
        if n <= 0 or r.import_kv is not None:
            return
        held = sum(int(w.import_kv.shape[2]) for w in self._waiting if w.swapped and w.import_kv is not None)
        if (held + n) * self.kv_bytes_per_token > self.swap_space_bytes:
            return
        r.import_kv = self.arrays.gather_tokens(self.pool.kv, r.blocks, n)
        self.executor.transfer("L2", n)  # device -> host
        r.swapped = True
        self.num_swapped_preemptions += 1

    def _unprepare(self, r: _Req) -> None:
        if r.blocks:
            self.pool.release(r.blocks)
        r.blocks = []
        r.num_computed = 0
        r.num_registered = 0
        r.prepared = False

    def _prepare_waiting(self) -> list[_Req]:
        """Prepare the head of the waiting queue that could be admitted this step; returns it."""
        if not self._waiting:  # nothing to admit (most decode steps)
            return []
        cfg = self.scheduler_config
        budget = cfg.max_num_batched_tokens
        reserve = 0
        for r in self._running:
            n = max(0, min(len(r.tokens) - r.num_computed, cfg.max_prefill_chunk_tokens, budget))
            budget -= n
            reserve += max(0, blocks_for(r.num_computed + n, self.block_size) - len(r.blocks))
        slots = cfg.max_num_seqs - len(self._running)
        out, failed = [], []
        for r in self._waiting:
            if slots <= 0 or budget <= 0:
                break
            if not r.prepared:
                try:
                    ready = self._prepare(r, reserve)
                except Exception as e:  # its prefix load / KV import failed: that request only
                    failed.append((r, e))
                    continue
                if not ready:
                    break
            out.append(r)
            n = max(0, min(len(r.tokens) - r.num_computed, cfg.max_prefill_chunk_tokens, budget))
            need = max(0, blocks_for(r.num_computed + n, self.block_size) - len(r.blocks))
            if need > self.pool.num_free_blocks() - reserve:
                break
            reserve += need
            budget -= n
            slots -= 1
        for r, err in failed:
            self._waiting.remove(r)
            self._fail(r, err, "prepare")
        return out

    # ------------------------------------------------------------------ L3 write-through
    def _write_through(self, r: _Req) -> None:
        if not r.write_through or self.connector is None:
            return
        bs = self.block_size
        n_prompt_full = r.prompt_len // bs
        if r.l3_next is None:
            self._ensure_hashes(r, n_prompt_full)
            # Blocks already visible are not rewritten but re-announced (BlockStored L3), so an
            # index that lost them (router restart, lost events) relearns them (issue 7 §6).
            announce = getattr(self.connector, "lookup_and_announce", None)
            try:
                if announce is not None:  # token ids from the chain's start: the request's list as is
                    # (the store slices each announced chunk's ids from it; no copy of the prompt)
                    r.l3_next = int(announce(r.hashes[:n_prompt_full], None, r.tokens, bs))
                else:
                    r.l3_next = int(self.connector.lookup(r.hashes[:n_prompt_full]))
            except Exception:
                log.warning("L3 lookup failed before write-through", exc_info=True)
                r.l3_next = 0
        upto = min(n_prompt_full, r.num_computed // bs)
        if r.l3_next >= upto:
            return
        self._ensure_hashes(r, upto)
        idx = range(r.l3_next, upto)
        blocks = [self.arrays.to_numpy(self.pool.block_view(r.blocks[i])) for i in idx]
        toks = r.tokens[r.l3_next * bs:upto * bs]
        parent = r.hashes[r.l3_next - 1] if r.l3_next else None
        try:
            self.connector.save(r.hashes[r.l3_next:upto], parent, toks, blocks)
        except Exception:
            log.warning("L3 write-through failed", exc_info=True)
        r.l3_next = upto

    # ------------------------------------------------------------------ failures
    def _fail(self, r: _Req, exc: BaseException, where: str, engine_failed: bool = False) -> None:
        """Finish one request with ``"error"`` and free its blocks; the others go on
        (the request must already be out of the waiting / running queues). ``engine_failed``: the
        engine, not the request, was at fault (a caller may retry it elsewhere)."""
        log.warning("request %s failed in %s: %r", r.id, where, exc, exc_info=exc)
        self.num_failed_requests += 1
        self._free(r)
        self._pending_outputs.append(StepOutput(r.id, [], True, "error", error=f"{where}: {exc!r}",
                                                engine_failed=engine_failed))

    def _fail_step(self, reqs: list[_Req], exc: BaseException) -> None:
        """The model forward failed: fail the requests it scheduled (their KV for this step may
        be half written), keep everything else. The next step starts from a consistent pool."""
        self.num_failed_steps += 1
        self.last_step_error = exc
        ids = {r.id for r in reqs}
        self._running = [r for r in self._running if r.id not in ids]
        for r in reqs:
            self._fail(r, exc, "step", engine_failed=True)

    def _write_through_guarded(self, r: _Req) -> None:
        """Write-through is a side effect for later requests: if it breaks (beyond the store
        faults :meth:`_write_through` already absorbs) this request just stops writing."""
        try:
            self._write_through(r)
        except Exception:
            log.warning("write-through of %s failed; continuing without it", r.id, exc_info=True)
            r.write_through = False

    # ------------------------------------------------------------------ step
    def step(self) -> list[StepOutput]:
        """Run one engine step; returns the outputs it produced (possibly none).

        Failure isolation: a failure attributable to one request (its prefix load or KV
        import, its sampling, a forward that fails with it alone) finishes that request with
        ``"error"``; :attr:`last_step_error` is set only when the engine itself failed (nothing
        of the step ran and a canary forward failed too). Either way the engine stays consistent
        and keeps serving.
        """
        with self._step_lock:
            self.last_step_error = None
            outputs = self._step_locked()
            outputs.extend(self._pending_outputs)
            self._pending_outputs = []
            self._update_load()
            return outputs

    def _admit(self, prepared: list[_Req]) -> tuple[SchedulePlan[str], dict[str, _Req]]:
        """Schedule this step: preempt, admit, and return ``(plan, requests by id)``."""
        cfg = self.scheduler_config
        by_id = {r.id: r for r in self._running}
        plan = schedule(
            [SeqState(r.id, len(r.tokens), r.num_computed, len(r.blocks)) for r in self._running],
            [SeqState(r.id, len(r.tokens), r.num_computed, len(r.blocks)) for r in prepared],
            self.pool.num_free_blocks(), cfg, lambda rid: self.pool.num_exclusive_blocks(by_id[rid].blocks))
        by_id.update({r.id: r for r in prepared})
        # preemption (recompute): free blocks, requeue at the front in admission order
        if plan.preempted:
            pre = set(plan.preempted)
            victims = [r for r in self._running if r.id in pre]
            self.num_preemptions += len(victims)
            self._running = [r for r in self._running if r.id not in pre]
            for r in reversed(victims):
                self._swap_out(r)
                self._unprepare(r)
                self._waiting.appendleft(r)
        admitted = set(plan.admitted)
        for r in prepared:
            if r.id not in admitted:
                self._unprepare(r)
        if admitted:
            self._waiting = collections.deque(r for r in self._waiting if r.id not in admitted)
            for r in prepared:
                if r.id in admitted:
                    r.import_kv, r.swapped = None, False
                    if r.admitted_at_s is None:
                        r.admitted_at_s = self._clock()
                        r.step_totals_at_admit = (self.step_tokens_total, self.step_s_total)
                    self._running.append(r)
                    self._write_through_guarded(r)
        return plan, by_id

    def _forward(self, sched: list[tuple[_Req, int]], new_blocks: list[int]):
        """Allocate the step's new blocks, run the executor's forward over all scheduled tokens
        and return the logits of the requests that sample this step (None if none does)."""
        for (r, n), nb in zip(sched, new_blocks):
            if nb:
                r.blocks.extend(self.pool.allocate(nb))
        return self._run_forward(sched)

    def _run_forward(self, sched: Sequence[tuple[_Req, int]]):
        """The executor's forward over ``sched`` (blocks already allocated); the logits of the
        requests that sample this step (None if none does)."""
        seqs = [ForwardSeq(r.num_computed, n, r.blocks, r.tokens, r.prompt_len) for r, n in sched]
        self._faults.check_step(r.sampling.seed for r, _ in sched)
        samplers = [i for i, (r, n) in enumerate(sched) if r.num_computed + n == len(r.tokens)]
        return self.executor.forward(seqs, self.pool.kv, samplers)

    def _try_forward(self, sched: Sequence[tuple[_Req, int]]) -> BaseException | None:
        try:
            self._run_forward(sched)
        except Exception as e:
            return e
        return None

    def _recover_forward(self, sched: list[tuple[_Req, int]], exc: BaseException):
        """The step's forward raised ``exc``. Fail only the requests that fail on their own
        (:func:`cpd.engine.isolation.isolate`) and run the others again; ``(survivors, logits)``.
        When no request ran and a canary forward (:meth:`probe`) fails too, the engine itself is at
        fault: a failed step (:attr:`last_step_error`). Otherwise the culprits were bad requests
        and the engine is healthy (no failed step)."""
        culprits = isolate(sched, exc, self._try_forward)
        log.warning("engine step failed (%r); %d of its %d requests fail on their own", exc, len(culprits),
                    len(sched))
        probe_error = self._canary() if len(culprits) == len(sched) else None
        if probe_error is not None:
            log.error("the engine fails a canary forward too (%r): a failed step", probe_error)
            self._fail_step([r for r, _ in sched], exc)
            return [], None
        bad = {sched[i][0].id for i in culprits}
        self._running = [r for r in self._running if r.id not in bad]
        for i, e in culprits.items():
            self._fail(sched[i][0], e, "forward")
        good = [(r, n) for r, n in sched if r.id not in bad]
        if not good:
            return [], None
        try:
            return good, self._run_forward(good)
        except Exception as e:  # failed again after isolation: nothing more to learn
            self._fail_step([r for r, _ in good], e)
            return [], None

    def probe(self) -> BaseException | None:
        """Run a canary forward (one token of a fresh sequence on a free block, released at once;
        no step, no output, no event unless a cached block had to be evicted for it): None if the
        engine computes at all, else the error. The worker probes an idle engine whose last step
        failed, instead of sacrificing a client's request to find out.

        Raises:
            NoFreeBlocks: every block is in use (held handoffs): no probe, nothing learnt."""
        with self._step_lock:
            blocks = self.pool.allocate(1)
            return self._canary(blocks)

    def _canary(self, blocks: list[int] | None = None) -> BaseException | None:
        """The canary forward on ``blocks`` (one block, released here; None: allocate one, and
        with none free the canary counts as failed: the engine cannot clear itself)."""
        if blocks is None:
            try:
                blocks = self.pool.allocate(1)
            except NoFreeBlocks as e:
                return e
        try:
            self._faults.check_step([None])
            self.executor.forward([ForwardSeq(0, 1, blocks, [0], 1)], self.pool.kv, [0])
        except Exception as e:
            return e
        finally:
            self.pool.release(blocks)
        return None

    def _sample_tokens(self, logits: Any, sreqs: list[_Req]) -> list[int | BaseException]:
        """One token per sampling request, or the exception its sampling raised."""
        histories = [self._history(r) for r in sreqs]
        if all(r.sampling.temperature == 0 for r in sreqs) and not any(histories) and not self._faults.active:
            return list(self.executor.greedy_tokens(logits))  # all greedy: one argmax, one sync
        out: list[int | BaseException] = []
        for row, (r, h) in enumerate(zip(sreqs, histories)):
            try:
                self._faults.check_sample(r.sampling.seed)
                out.append(self.executor.sample_token(logits, row, r.sampling, r.num_output, h))
            except Exception as e:  # this request's sampling only
                out.append(e)
        return out

    def _step_locked(self) -> list[StepOutput]:
        self._drain_inbox()
        outputs, self._pending_outputs = self._pending_outputs, []
        prepared = self._prepare_waiting()
        plan, by_id = self._admit(prepared)
        if not plan.scheduled:
            if not self._running:
                self.executor.idle()
            return outputs
        sched = [(by_id[s.request_id], s.num_new_tokens) for s in plan.scheduled]
        t0 = self._clock()
        try:
            logits = self._forward(sched, [s.num_new_blocks for s in plan.scheduled])
        except Exception as e:
            sched, logits = self._recover_forward(sched, e)
            if not sched:
                return outputs
        self.num_steps += 1
        bs = self.block_size
        for r, n in sched:
            r.num_computed += n
            if r.num_computed // bs > r.num_registered:  # a block became full
                self._register_full(r)
            if r.write_through:
                self._write_through_guarded(r)
        sreqs = [r for r, n in sched if r.num_computed == len(r.tokens)]
        tokens = self._sample_tokens(logits, sreqs) if sreqs else []
        self.step_tokens_total += sum(n for _, n in sched)
        self.step_s_total += self._clock() - t0
        if not sreqs:
            return outputs
        finished: list[tuple[_Req, str]] = []
        for r, tok in zip(sreqs, tokens):
            if isinstance(tok, BaseException):
                self._running.remove(r)
                self._fail(r, tok, "sampling")
                continue
            out, reason = self._append_token(r, tok)
            outputs.append(out)
            if reason is not None:
                finished.append((r, reason))
        if finished:
            done = {r.id for r, _ in finished}
            self._running = [r for r in self._running if r.id not in done]
            for r, reason in finished:
                if reason == "handoff":
                    self._held[r.id] = r  # KV kept for export_kv / release (id stays taken)
                else:
                    self._free(r)
            if not self._running:
                self.executor.idle()
        return outputs

    @staticmethod
    def _history(r: _Req) -> TokenHistory | None:
        """What ``r``'s next token depends on besides the logits (None: nothing): its tokens for
        the penalties, its stop ids while ``min_tokens`` is not reached."""
        banned = r.stop_ids if r.num_output < r.sampling.min_tokens else frozenset()
        if not banned and not r.sampling.uses_history:
            return None
        return TokenHistory(r.tokens, r.prompt_len, banned)

    def _append_token(self, r: _Req, tok: int) -> tuple[StepOutput, str | None]:
        """Add a sampled token to a request; returns its output and finish reason (or None)."""
        r.tokens.append(tok)
        r.num_output += 1
        reason = None
        if tok in r.stop_ids and r.num_output > r.sampling.min_tokens:
            reason = "stop"
        elif r.num_output >= r.sampling.max_tokens or len(r.tokens) >= self.max_model_len:
            reason = "length"
        elif r.mode == "prefill":
            reason = "handoff"
        out = StepOutput(r.id, [tok], reason is not None, reason)
        if not r.sent_first:
            out.num_cached_tokens_by_tier = dict(r.cached_by_tier)
            out.queue_s = (r.admitted_at_s or r.added_at_s) - r.added_at_s
            tokens0, s0 = r.step_totals_at_admit
            out.step_tokens, out.step_s = self.step_tokens_total - tokens0, self.step_s_total - s0
            r.sent_first = True
        return out, reason
