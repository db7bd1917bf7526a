"""Discrete-event simulator on the live engine objects (issue 10 §2).

Every instance is a real :class:`cpd.engine.engine.Engine` (scheduler, L1 pool with its prefix
cache and LRU, L2 host pool, prefix-load path L1 → L2 → L3 → recompute, chunk and block
arithmetic) with a :class:`~cpd.engine.executor_modeled.ModeledExecutor` on a
:class:`VirtualClock`: an engine step runs at once, the waits it asks for (step time,
L2/L3/handoff transfers) are summed, and its outputs are delivered that much later on the
virtual clock. The router side is the live one too: the request's block hashes
(:func:`cpd.kv.block_hash.hash_blocks`, from the ids' u32le bytes), the router's
:class:`cpd.router.index.PrefixIndex` fed with each engine's real KV events ``kv_event_delay_s``
after the step that produced them,
the live :func:`cpd.policy.routing.route`, and the live dispatch's load accounting
(queued prefill tokens and ``queued_prefill_s`` added at dispatch, removed when the first
token returns). L3 is the real in-memory store (``mem://``, :mod:`cpd.store.mem_store`) behind
the real :class:`L3Connector`.

Deterministic: one heap ordered by ``(time, insertion counter)``, no wall clock, no threads;
tokens are derived from the trace's block ids (:func:`block_tokens`).
"""
from __future__ import annotations

import collections
import functools
import gc
import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import numpy as np

from cpd.engine.engine import Engine, EngineRequest, SamplingParams, loads_since
from cpd.engine.executor_modeled import ModeledExecutor, ModeledModelConfig
from cpd.engine.scheduler import SchedulerConfig, blocks_for
from cpd.kv.block_hash import hash_blocks_u32le
from cpd.kv.events import KVEventBatch
from cpd.policy.cost_model import RooflineCostModel
from cpd.policy.routing import DispatchRates, Overloaded, RoutingConfig, WorkerLoad, max_cached_blocks, route, work_s
from cpd.policy.prefill_queue import QueuedPrefills
from cpd.router.dispatch_records import observe_prefill
from cpd.router.estimates import CostEstimates
from cpd.router.index import PrefixIndex
from cpd.sim.core_share import CoreShare
from cpd.sim.step_end_connector import StepEndL3Connector
from cpd.sim.workload import SimRequest
from cpd.types import PREFILL_SIDE_ROLES, Role, Tier

VOCAB = 1 << 17  # token ids of the synthetic blocks
DECODE, PRE_PREFILL = "decode", "pre-prefill"  # roles (cpd.types.Role values)



class VirtualClock:
    """Collects the waits of one engine step (virtual seconds) instead of sleeping."""

    def __init__(self) -> None:
        self.pending_s = 0.0

    def wait(self, seconds: float) -> None:
        self.pending_s += seconds

    def take(self) -> float:
        s, self.pending_s = self.pending_s, 0.0
        return s


_C1, _C2, _C3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@functools.lru_cache(maxsize=8)
def _position_terms(block_size: int) -> np.ndarray:
    """``position * C2`` (mod 2**64) for positions ``1..block_size`` (read-only: shared)."""
    with np.errstate(over="ignore"):
        out = np.arange(1, block_size + 1, dtype=np.uint64) * _C2
    out.flags.writeable = False
    return out


def _token_rows(block_ids: Sequence[int], block_size: int, vocab_size: int = VOCAB) -> np.ndarray:
    """The token ids of trace blocks as a ``(len(block_ids), block_size)`` uint64 array: splitmix64
    of ``(block_id, position)`` in ``[1, vocab_size)`` (a different run per block id). Computed
    in place on one array (one temporary): the same values as the plain expression, ≈2.5x
    faster (a 100 K-token prompt is built per request)."""
    ids = np.array([b & 0xFFFFFFFFFFFFFFFF for b in block_ids], dtype=np.uint64).reshape(-1, 1)
    with np.errstate(over="ignore"):
        x = ids * _C1 + _position_terms(block_size)
        t = x >> np.uint64(30)
        x ^= t
        x *= _C2
        np.right_shift(x, np.uint64(27), out=t)
        x ^= t
        x *= _C3
        np.right_shift(x, np.uint64(31), out=t)
        x ^= t
        np.remainder(x, np.uint64(vocab_size - 1), out=x)
        x += np.uint64(1)
    return x


def blocks_tokens(block_ids: Sequence[int], block_size: int, vocab_size: int = VOCAB) -> list[list[int]]:
    """The deterministic token ids of trace blocks, one list per block id: splitmix64 of
    ``(block_id, position)`` in ``[1, vocab_size)`` (a different run per block id)."""
    out: list[list[int]] = _token_rows(block_ids, block_size, vocab_size).tolist()
    return out


def block_tokens(block_id: int, block_size: int, vocab_size: int = VOCAB) -> list[int]:
    """The token ids of one trace block (see :func:`blocks_tokens`)."""
    return blocks_tokens([block_id], block_size, vocab_size)[0]


def request_tokens(r: SimRequest, block_size: int, cache: dict[int, list[int]], vocab_size: int = VOCAB) -> list[int]:
    """The prompt token ids of ``r``: its blocks' tokens, cut to ``prompt_tokens`` (block token
    lists are computed once per block id and kept in ``cache``)."""
    need = blocks_for(r.prompt_tokens, block_size)
    blocks = r.blocks[:need]
    missing = [b for b in dict.fromkeys(blocks) if b not in cache]
    if missing:
        cache.update(zip(missing, blocks_tokens(missing, block_size, vocab_size)))
    toks: list[int] = []
    for b in blocks:
        toks.extend(cache[b])
    del toks[r.prompt_tokens:]
    return toks


def prompt_u32(blocks: Sequence[int], num_tokens: int, block_size: int, vocab_size: int = VOCAB) -> np.ndarray:
    """The first ``num_tokens`` token ids of the blocks ``blocks`` (the prompt of
    :func:`request_tokens`) as one little-endian uint32 array: computed afresh (a few ms for a
    100 K-token prompt) instead of kept per block id, and hashed from its bytes
    (:func:`cpd.kv.block_hash.hash_blocks_u32le`, the same hashes as ``hash_blocks`` of the
    ids)."""
    rows = _token_rows(blocks[:blocks_for(num_tokens, block_size)], block_size, vocab_size)
    return rows.reshape(-1)[:num_tokens].astype("<u4")


class PromptCache:
    """The u32 token ids and block hashes of recent prompts' full blocks, so that a session's next
    turn (its previous prompt's blocks plus a few new ones) computes and hashes only its new
    blocks: the same ids (:func:`prompt_u32` is per block id) and the same hashes (the chain
    continued from the cached prefix's last hash). An entry is keyed by the id of its last block
    and holds the whole block-id prefix it covers (checked on a hit, so any workload is served
    right); a hit that is extended replaces its entry. Bounded: least recently used entries go
    beyond ``max_bytes`` of token ids (a session's turns come in longest-idle order, so the bound
    must hold the sessions' working set to help: ≈ 4 bytes × context tokens × sessions)."""

    def __init__(self, block_size: int, max_bytes: int = 512 << 20) -> None:
        self.bs = block_size
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._lru: collections.OrderedDict[int, tuple[tuple[int, ...], np.ndarray, list[int]]] = \
            collections.OrderedDict()
        self.hits = self.misses = 0

    def longest(self, blocks: Sequence[int], num_full: int) -> tuple[int, np.ndarray | None, list[int]]:
        """``(n, ids, hashes)``: the longest cached prefix of ``blocks[:num_full]`` (its entry is
        removed: the caller puts the extended one back), or ``(0, None, [])``."""
        lru = self._lru
        for n in range(num_full, 0, -1):
            e = lru.get(blocks[n - 1])
            if e is not None and len(e[0]) == n and e[0] == tuple(blocks[:n]):
                del lru[blocks[n - 1]]
                self.nbytes -= e[1].nbytes
                self.hits += 1
                return n, e[1], e[2]
        self.misses += 1
        return 0, None, []

    def put(self, blocks: Sequence[int], ids: np.ndarray, hashes: list[int]) -> None:
        """Keep ``ids`` (u32, the full blocks ``blocks``) and their ``hashes``."""
        if not len(blocks) or ids.nbytes > self.max_bytes:
            return
        old = self._lru.pop(blocks[-1], None)
        if old is not None:
            self.nbytes -= old[1].nbytes
        self._lru[blocks[-1]] = (tuple(blocks), ids, hashes)
        self.nbytes += ids.nbytes
        while self.nbytes > self.max_bytes:
            _, (_, a, _) = self._lru.popitem(last=False)
            self.nbytes -= a.nbytes


@dataclass(frozen=True)
class EngineInstanceSpec:
    """One engine instance: role, cost model, scheduler limits, L1 blocks, L2 bytes (modeled)."""

    role: str
    cost: RooflineCostModel
    sched: SchedulerConfig
    l1_blocks: int
    l2_bytes: int = 0


def instance_cost_prior(spec: EngineInstanceSpec, has_l3: bool, time_dilation: float = 1.0) -> dict[str, float]:
    """What a modeled worker of ``spec`` advertises to the router (its ``GET /info`` ``cost_prior``,
    :func:`cpd.worker.server.engine_cost_prior`), as the JSON values the router hands to
    :meth:`CostEstimates.advertise`; ``has_l3`` False drops the L3 figure (no store)."""
    from cpd.costmodel.prior import cost_prior
    p = cost_prior(spec.cost, time_dilation=time_dilation, max_num_batched_tokens=spec.sched.max_num_batched_tokens,
                   max_prefill_chunk_tokens=spec.sched.max_prefill_chunk_tokens)
    out = {"prefill_tokens_per_s": p.prefill_tokens_per_s, "attn_coeff": p.attn_coeff, "l2_bytes_per_s": p.l2_bytes_per_s,
           "l3_bytes_per_s": p.l3_bytes_per_s if has_l3 else None}
    return {k: float(v) for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class EngineClusterSpec:
    instances: tuple[EngineInstanceSpec, ...]
    routing: RoutingConfig
    router_cost: Any  # a CostModel (the live router's LinearCostModel, or a roofline)
    block_size: int = 512
    l3_bytes: int = 0  # modeled L3 capacity; 0 = no L3
    kv_event_delay_s: float = 0.05
    raw_ready_margin_s: float = 0.05  # pending L3 writes: predicted visible this long after the prefill
    elastic: Any = None  # a cpd.policy.roles.PlannerConfig: call plan_roles every interval_s (None: fixed roles)
    learn_router_cost: bool = False  # the router learns router_cost's prefill terms from the simulated
    # prefills as the live router does (cpd.router.estimates); False: router_cost stays fixed
    fit_router_cost: bool = False  # with learn_router_cost: fit (router.prefill_cost_fit), not one rate
    learn_like_live: bool = False  # with learn_router_cost, the rest of what the live router does
    # (cpd.router.app, cpd.router.dispatch_records): router_cost is only the base (the live one is
    # LinearCostModel's defaults); every instance advertises its CostPrior (cpd.costmodel.prior, as
    # cpd.worker.server.engine_cost_prior: L3 only with a store) and the estimates start from their
    # mean (CostEstimates.advertise); each prefill answer reports the instance's L2/L3 loads since
    # its last answer (bytes, modeled seconds: the worker's new_transfers) to observe_transfer before
    # observe_prefill; a read-after-write hold is not compute (the live worker never sees it).
    # False: learn the prefill terms only, from router_cost (the adaptive-grid cells' "learned").
    l3_events_next_flush: bool = False  # True: a step's write-through events (BlockStored L3) are
    # published with the worker's NEXT event flush, as the live worker did before 407a3ff (the engine
    # handed the blocks to the connector's writer thread at the step's end and the worker flushed its
    # events right after the step, before the write was done, so they went out after the next step,
    # or idle_flush_s after it when idle); kept to reproduce the live runs recorded before that fix
    # (docs/results/modeled_ordering). False (default, live since 407a3ff: the writer thread
    # publishes when the store has the blocks): at the step's end with its L1 events. Either way
    # kv_event_delay_s is added, and the blocks are readable in L3 from the step's end.
    idle_flush_s: float = 0.05  # the idle worker loop's event flush period (cpd.worker.runtime: 0.05 s wall; / K)
    cores: int = 0  # > 0: the instances share this many CPU cores (cpd.sim.core_share); 0: a device each
    queue_remaining: bool = False  # queued_prefill_s counts a started prefill's remaining estimate (its
    # estimate less the time since the step that started it), not the whole one until its first token
    request_overhead_s: float = 0.0  # instance time per request whose first token a step produces: the
    # live stack's per-request work that an engine step's cost does not hold (HTTP, the handoff's staging)


@dataclass
class _Inst:
    wid: str
    role: Role
    engine: Engine
    clock: VirtualClock
    batches: list = field(default_factory=list)
    seq: int = -1
    busy: bool = False
    busy_s: float = 0.0
    queued_prefill_tokens: int = 0
    queued: QueuedPrefills = field(default_factory=QueuedPrefills)  # the WorkerLoad's queued_prefill_s
    running_requests: int = 0
    pending_handoffs: int = 0  # decode: routed here, KV not imported yet
    step_version: int = 0  # shared cores: the current completion event of the running step
    step_outs: Any = None  # shared cores: the running step's outputs, delivered when it ends
    l3_writer: StepEndL3Connector | None = None  # the engine's connector (prefill side with L3)
    wait_s: dict = field(default_factory=dict)  # modeled seconds the executor waited, by kind (L2, L3, step)
    transfers_reported: dict = field(default_factory=dict)  # tier -> (bytes, s) at the last answer
    l3_deferred: bool = False  # L3 events wait in batches for the next flush (l3_events_next_flush)
    flushes: int = 0  # publishes so far (an idle flush scheduled before a later publish is stale)
    rates: DispatchRates = field(default_factory=DispatchRates)  # short and heavy dispatches here (rule A3)


class EngineSimulator:
    """Run a workload on engine instances (see module docstring).

    Records per request (``rec[i]`` dict): ``arrival``, ``cls``, ``pool``, ``worker``, ``decode``,
    ``est_s`` (the router's own-work estimate), ``l1``/``l2``/``l3`` (prompt tokens loaded per
    tier), ``ttft_t``, ``done_t``; ``rejected`` (SLO-predictive admission said no: no times).
    Decode-local appends (``pool == "decode"``) run prefill and decode on the decode worker.

    Elastic roles (``cluster.elastic``): every ``interval_s`` of virtual time the live planner
    :func:`cpd.policy.roles.plan_roles` gets a :class:`cpd.policy.role_window.RoleWindow`
    observation (fed here exactly as the live dispatch feeds it) and its role changes are
    applied to the instances at once (``role_changes`` lists them with their times).
    """

    def __init__(self, cluster: EngineClusterSpec, requests: Sequence[SimRequest], stop_s: float | None = None,
                 vocab_size: int = VOCAB, prewarm: Sequence[Sequence[int]] = ()):
        self.c = cluster
        self.bs = cluster.block_size
        self.now = 0.0
        self._q: list = []
        self._n = 0
        self.stop_s = stop_s
        self.vocab_size = vocab_size
        self._store_name = f"cpd-sim-{id(self):x}"  # process-local L3 (cpd.store.mem_store)
        self.index = PrefixIndex()
        self._share = CoreShare(cluster.cores) if cluster.cores > 0 else None
        self._prompts = PromptCache(self.bs)
        self.estimates = (CostEstimates(cluster.router_cost, fit_prefill=cluster.fit_router_cost)
                          if cluster.learn_router_cost else None)
        self.insts: list[_Inst] = []
        self._weights_digest: str | None = None  # the cluster's one namespace (see _instance)
        counts: dict[str, int] = {}
        for spec in cluster.instances:
            k = counts[spec.role] = counts.get(spec.role, -1) + 1
            self.insts.append(self._instance(f"{spec.role}-{k}", spec))
        self.by_id = {w.wid: w for w in self.insts}
        for w in self.insts:
            w.queued.count_elapsed = cluster.queue_remaining
        if self.estimates is not None and cluster.learn_like_live:
            for w, spec in zip(self.insts, cluster.instances):
                self.estimates.advertise(w.wid, instance_cost_prior(spec, has_l3=w.l3_writer is not None))
        self.namespace = self.insts[0].engine.namespace
        if any(r.deps() for r in requests):
            self.reqs = list(requests)  # closed loop: indices must stay as generated
        else:
            self.reqs = sorted(requests, key=lambda r: r.arrival_s)
        self.rec: list[dict[str, Any] | None] = [None] * len(self.reqs)
        self._parked: dict[int, list[int]] = {}
        self.events_run = 0
        self.rejected = 0
        self.role_changes: list[dict[str, Any]] = []
        self.role_window = None
        self._gc_was_enabled = gc.isenabled()
        gc.disable()  # see run(); re-enabled when the run ends
        if cluster.elastic is not None:
            from cpd.policy.role_window import RoleWindow
            from cpd.policy.roles import PlannerState
            self.role_window = RoleWindow(ttft_slo_s=cluster.routing.ttft_slo_s)
            self._planner_state = PlannerState()
            self.at(cluster.elastic.interval_s, self._plan_roles)
        self._prewarm(prewarm)
        for i, r in enumerate(self.reqs):
            self.at(r.arrival_s, self._arrive, i)

    def _prompt(self, r: SimRequest) -> tuple[np.ndarray, list[int]]:
        """The prompt token ids of request ``r`` (:func:`request_tokens`) as one :func:`prompt_u32`
        array (the engine takes it as is: one C conversion, no per-id checks) and the block
        hashes of its full blocks (what the live router computes with ``hash_blocks``), from
        that array's bytes; the longest prefix of full blocks seen in a recent prompt comes from
        the :class:`PromptCache` (the same ids and hashes), only the rest is computed."""
        bs, full = self.bs, r.prompt_tokens // self.bs
        n, head, hashes = self._prompts.longest(r.blocks, full)
        if head is None:
            ids = prompt_u32(r.blocks, r.prompt_tokens, bs, self.vocab_size)
            hashes = hash_blocks_u32le(ids.tobytes(), self.namespace)
        else:
            tail = prompt_u32(r.blocks[n:], r.prompt_tokens - n * bs, bs, self.vocab_size)
            ids = np.concatenate((head, tail))
            hashes = hashes + hash_blocks_u32le(tail[:(full - n) * bs].tobytes(), self.namespace,
                                                parent_hash=hashes[-1])
        self._prompts.put(r.blocks[:full], ids[:full * bs], hashes)
        return ids, hashes

    def _prewarm(self, sessions: Sequence[Sequence[int]]) -> None:
        """Sessions that exist before t=0, their events applied to the index at once: with L3,
        their full blocks are written to L3 through a prefill-side engine's connector; without,
        they go to the L2 host pools of the prefill-side engines, round-robin (as if computed
        there earlier and spilled from L1). Their blocks are hashed from the token ids' bytes and
        their events carry no token ids (the router's index keys blocks by hash only; making the
        Python ints of every prewarmed token cost seconds and gigabytes)."""
        side = [w for w in self.insts if w.role != DECODE]
        if not side or not sessions:
            return
        lay = side[0].engine.executor.kv_layout
        payload = side[0].engine.arrays.zeros((lay.num_layers, 2, self.bs, lay.num_kv_heads, lay.head_dim))
        writer = next((w.l3_writer for w in side if w.l3_writer is not None), None)
        no_tokens: list[int] = []
        for k, blocks in enumerate(sessions):
            ids = prompt_u32(blocks, len(blocks) * self.bs, self.bs, self.vocab_size)
            hashes = hash_blocks_u32le(ids.tobytes(), self.namespace)
            self._prompts.put(blocks, ids, hashes)  # the session's next turn starts with them
            if writer is not None:
                writer.save(hashes, None, no_tokens, [payload] * len(hashes))
                writer.apply_pending()
                continue
            hp = side[k % len(side)].engine.host_pool
            for j, h in enumerate(hashes):
                hp.put(h, hashes[j - 1] if j else None, no_tokens, payload)
        for w in side:
            if w.batches:
                w.seq += 1
                self.index.apply_batch(w.wid, w.seq, KVEventBatch(ts=0.0, events=w.batches))
                w.batches = []

    def _instance(self, wid: str, spec: EngineInstanceSpec) -> _Inst:
        clock = VirtualClock()
        cfg = ModeledModelConfig(vocab_size=self.vocab_size, max_position_embeddings=spec.cost.model.max_context)
        ex = ModeledExecutor(spec.cost, cfg, clock=clock, model_id="sim")
        # One namespace for the whole cluster, the router's (the first instance's): the modeled
        # executor names its weights by TP (``...:tp4`` prefill nodes, ``...:tp1`` decode ranks),
        # so the decode engines hashed their blocks apart and the router never matched their L1
        # (rule 6 affinity, rule A4 appends). The live router refuses a worker of another namespace.
        if self._weights_digest is None:
            self._weights_digest = ex.weights_digest
        ex.weights_digest = self._weights_digest
        connector = None
        w_box: list[_Inst] = []
        sink: Callable[[Any], None] = lambda ev: w_box[0].batches.append(ev)
        if self.c.l3_bytes and spec.role != DECODE:
            from cpd.store import open_store
            store = open_store(f"mem://{self._store_name}", capacity_bytes=ex.payload_bytes(self.c.l3_bytes))
            # synchronous writes, deterministic (the live connector writes in a background thread),
            # applied when the step that computed the blocks ends (_step_done), not at its start
            connector = StepEndL3Connector(store, event_sink=sink)
        # the engine's clock: virtual now plus the waits of the step running (a live engine's clock
        # moves during a step; its step figures, step_s, must too)
        eng = Engine(None, num_blocks=spec.l1_blocks, block_size=self.bs, host_kv_bytes=spec.l2_bytes,
                     scheduler_config=spec.sched, connector=connector, event_sink=sink, executor=ex,
                     clock=lambda: self.now + clock.pending_s)
        w = _Inst(wid, Role(spec.role), eng, clock, l3_writer=connector)
        w_box.append(w)
        if self.c.learn_like_live:
            ex.on_wait = lambda what, s: w.wait_s.__setitem__(what, w.wait_s.get(what, 0.0) + s)
        return w

    def _new_transfers(self, w: _Inst) -> dict[str, tuple[int, float]]:
        """``w``'s L2/L3 loads since its last answer, ``{tier: (bytes, modeled s)}``, as the live
        worker reports them (:meth:`cpd.worker.server.WorkerState.new_transfers`: L3 only with a
        store, a tier only when it loaded more bytes); the seconds are the modeled transfer waits."""
        eng = w.engine
        now = {"L2": (eng.l2_load_bytes, w.wait_s.get("L2", 0.0))}
        if w.l3_writer is not None:
            now["L3"] = (eng.l3_load_bytes, w.wait_s.get("L3", 0.0))
        out = loads_since(now, w.transfers_reported)
        w.transfers_reported = now
        return out

    def close(self) -> None:
        from cpd.store.mem_store import drop_space
        drop_space(self._store_name)

    # -- event queue -------------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self._n += 1
        heapq.heappush(self._q, (t, self._n, fn, args))

    def run(self) -> "EngineSimulator":
        # The engine objects allocate millions of small lists (token ids, events) that live
        # long; the cyclic GC would rescan them over and over (it is off from the constructor
        # on, which builds the prewarm state). Nothing in a run depends on it.
        gc.disable()
        try:
            while self._q:
                t, _, fn, args = heapq.heappop(self._q)
                if self.stop_s is not None and t > self.stop_s:
                    self.now = self.stop_s
                    break
                self.now = t
                fn(t, *args)
                self.events_run += 1
        finally:
            self.close()
            if self._gc_was_enabled:
                gc.enable()
        return self

    # -- router ------------------------------------------------------------------------
    def _router_cost(self) -> Any:
        """The cost model the router prices with now (fixed, or fitted so far)."""
        return self.estimates.model() if self.estimates is not None else self.c.router_cost

    def router_cost_model(self) -> Any:
        """The cost model the router prices with now (after :meth:`run`: at the end)."""
        return self._router_cost()

    def _loads(self) -> list[WorkerLoad]:
        return [WorkerLoad(w.wid, w.role, w.queued_prefill_tokens, w.running_requests,
                           w.engine.load_stats()["kv_usage"], True, queued_prefill_s=w.queued.queued_s(self.now),
                           pending_handoffs=w.pending_handoffs, **w.rates.load_fields(self.now))
                for w in self.insts]

    def _arrive(self, now: float, i: int, released: bool = False) -> None:
        if not released and self._park(i):
            return
        r = self.reqs[i]
        toks, hashes = self._prompt(r)
        match = self.index.match(hashes, l3_max_blocks=max_cached_blocks(len(toks), self.bs), now_s=now)
        try:
            d = route(len(toks), match, self._loads(), self.c.routing, self._router_cost())
        except Overloaded:
            self.rejected += 1
            self.rec[i] = {"arrival": now, "cls": None, "pool": None, "worker": None, "decode": None, "est_s": 0.0,
                           "ttft_t": None, "done_t": None, "rejected": True}
            self._release(now, i)  # a closed-loop session goes on (the client got its 429)
            return
        w = self.by_id[d.prefill_worker]
        rc = d.recompute  # the load-vs-recompute outcome, as the live dispatch reads it
        recompute_l3 = rc is not None and rc.tier == "L3"
        cached_blocks = d.load_plan.num_cached_blocks
        est_s = work_s(d.load_plan, len(toks), self.c.routing, self._router_cost())
        if d.write_through and hashes[cached_blocks:]:
            self.index.add_pending_writes(hashes[cached_blocks:], now + d.estimated_ttft_s + self.c.raw_ready_margin_s)
        if self.role_window is not None and d.pool in PREFILL_SIDE_ROLES:
            self.role_window.observe_dispatch(now, d, est_s)
        w.queued_prefill_tokens += len(toks)
        w.queued.add(i, est_s)
        w.running_requests += 1
        if d.pool in PREFILL_SIDE_ROLES:
            w.rates.observe(now, d.request_class, est_s)
        if not d.decode_append and d.decode_worker is not None:
            self.by_id[d.decode_worker].pending_handoffs += 1
        rec = self.rec[i] = {"arrival": now, "cls": str(d.request_class), "pool": str(d.pool), "worker": w.wid,
                             "decode": d.decode_worker, "est_s": est_s, "ttft_t": None, "done_t": None}
        req = EngineRequest(str(i), cast(Sequence[int], toks), SamplingParams(max_tokens=r.output_tokens, ignore_eos=True),
                            mode="full" if d.decode_append else "prefill",
                            max_l3_blocks=d.load_plan.l3_blocks if recompute_l3 else None,
                            write_through=d.write_through, block_hashes=hashes)
        if d.wait_for_l3_s > 0:  # read-after-write: the dispatch holds for the pending L3 blocks
            rec["hold_s"] = d.wait_for_l3_s
            self.at(now + d.wait_for_l3_s, self._submit, w, req)
        else:
            self._submit(now, w, req)

    def _submit(self, now: float, w: _Inst, req: EngineRequest) -> None:
        w.engine.add_request(req)
        self._kick(now, w)

    def _plan_roles(self, now: float) -> None:
        """One elastic-roles round (see class docstring)."""
        from cpd.policy.roles import plan_roles
        assert self.role_window is not None and self.c.elastic is not None
        obs = self.role_window.observation(now, self._loads())
        changes, self._planner_state = plan_roles(obs, self._planner_state, self.c.elastic)
        for ch in changes:
            w = self.by_id[ch.worker_id]
            if w.role != ch.from_role or w.role == DECODE or ch.to_role == DECODE:
                raise RuntimeError(f"planner asked for an impossible role change {ch}")
            w.role = Role(ch.to_role)
            self.role_changes.append({"t": now, "worker": ch.worker_id, "from": str(ch.from_role),
                                      "to": str(ch.to_role), "reason": ch.reason})
        if self._q:  # other work pending: keep planning (an empty queue means the run is over)
            self.at(now + self.c.elastic.interval_s, self._plan_roles)

    # -- engines -----------------------------------------------------------------------
    def _kick(self, now: float, w: _Inst, continuing: bool = False) -> None:
        """Start ``w``'s next step if it is idle and has work. ``continuing``: called at the end of
        its previous step (the live loop steps again without a flush in between); otherwise new
        work woke an idle worker, whose loop flushes pending events first."""
        if w.busy:
            return
        if w.l3_deferred and not continuing:
            self._publish(now, w)
        if not w.engine.has_unfinished():
            return
        outs = w.engine.step()
        if w.queued.count_elapsed and w.role != DECODE:  # a decode-local append counts whole (as live)
            self._note_started(now, w)
        dt = w.clock.take()
        if self.c.request_overhead_s > 0 and outs:
            dt += self.c.request_overhead_s * self._num_first_tokens(outs)
        if self._share is None or (dt <= 0 and not outs):
            self._publish(now + dt, w)
        if dt <= 0 and not outs:
            return  # nothing could run (e.g. an import waits for blocks): a later event kicks again
        w.busy = True
        w.busy_s += dt
        if self._share is None:
            self.at(now + dt, self._step_done, w, outs)
            return
        w.step_outs = outs
        self._share.start(now, w.wid, dt)
        self._reschedule_shared()

    def _note_started(self, now: float, w: _Inst) -> None:
        """Prefills queued on ``w`` that the step starting at ``now`` computes (or has computed): from
        here their remaining estimate counts (:class:`QueuedPrefills`, ``queue_remaining``)."""
        for k in w.queued.unstarted():
            if w.engine.request_state(str(k)) in ("running", "held"):
                w.queued.start(k, now)

    def _num_first_tokens(self, outs) -> int:
        """Requests whose first token is among ``outs`` (their prefill ends in this step)."""
        return sum(1 for o in outs if o.new_token_ids and self._record(int(o.request_id))["ttft_t"] is None)

    def _reschedule_shared(self) -> None:
        """Shared cores: every running step's completion, for the running set as it is now (an
        earlier completion event of a step is stale from here on and is skipped)."""
        assert self._share is not None
        for wid, t in self._share.finish_times().items():
            w = self.by_id[wid]
            w.step_version += 1
            self.at(t, self._shared_step_done, w, w.step_version)

    def _shared_step_done(self, now: float, w: _Inst, version: int) -> None:
        if version != w.step_version or not w.busy:
            return
        assert self._share is not None
        self._share.finish(now, w.wid)
        self._publish(now, w)
        outs, w.step_outs = w.step_outs, None
        self._reschedule_shared()
        self._step_done(now, w, outs)

    def _publish(self, t: float, w: _Inst) -> None:
        w.l3_deferred = False
        if not w.batches:
            return
        w.flushes += 1
        w.seq += 1
        batch = KVEventBatch(ts=t, events=w.batches)
        w.batches = []
        self.at(t + self.c.kv_event_delay_s, self._apply_events, w.wid, w.seq, batch)

    def _idle_flush(self, now: float, w: _Inst, flushes: int) -> None:
        """The idle worker loop's periodic flush (``l3_events_next_flush``)."""
        if w.l3_deferred and w.flushes == flushes and not w.busy:
            self._publish(now, w)

    def _apply_events(self, now: float, wid: str, seq: int, batch: KVEventBatch) -> None:
        self.index.apply_batch(wid, seq, batch)

    def _step_done(self, now: float, w: _Inst, outs) -> None:
        w.busy = False
        if w.l3_writer is not None and w.l3_writer.num_pending_saves:
            w.l3_writer.apply_pending()  # the step's write-through lands at its end
            if self.c.l3_events_next_flush:
                w.l3_deferred = True  # its L3 events go out with the next flush
            else:
                self._publish(now, w)  # with its L3 events
        for o in outs:
            i = int(o.request_id)
            rec = self._record(i)
            if o.num_cached_tokens_by_tier is not None and "l1" not in rec:
                rec.update({t.lower(): n for t, n in o.num_cached_tokens_by_tier.items()})
            if o.new_token_ids and rec["ttft_t"] is None:  # first token: prefill side or decode-local append
                rec["ttft_t"] = now
                wid = self.by_id[rec["worker"]]
                wid.queued_prefill_tokens -= self.reqs[i].prompt_tokens
                wid.queued.remove(i)
                if rec["pool"] != DECODE:  # a decode-local append keeps running there until done
                    wid.running_requests -= 1
                if self.estimates is not None:  # as the live dispatch records a prefill answer
                    compute_s = now - rec["arrival"] - (o.queue_s or 0.0)
                    if self.c.learn_like_live:
                        for tier, (nbytes, seconds) in self._new_transfers(wid).items():
                            self.estimates.observe_transfer(tier, nbytes, seconds)
                        compute_s -= rec.get("hold_s", 0.0)
                    by_tier = {Tier(t): n for t, n in (o.num_cached_tokens_by_tier or {}).items()}
                    observe_prefill(self.estimates, by_tier, self.reqs[i].prompt_tokens,
                                    compute_s, o.step_tokens, o.step_s)
                if self.role_window is not None and wid.role in PREFILL_SIDE_ROLES:
                    ttft = now - rec["arrival"]
                    self.role_window.observe_prefill_done(now, wid.role, max(0.0, ttft - rec["est_s"]), ttft)
            if o.finish_reason == "handoff":
                self._handoff(now, w, i)
            elif o.finished:
                rec["done_t"] = now
                self._finished_on(w, rec)
                self._release(now, i)
        self._kick(now, w, continuing=True)
        if w.l3_deferred and not w.busy:
            self.at(now + self.c.idle_flush_s, self._idle_flush, w, w.flushes)

    def _finished_on(self, w: _Inst, rec: dict[str, Any]) -> None:
        """Decode load bookkeeping of a finished request: it leaves the running count of the decode
        worker it ran on, or, when it finished on the prefill side without a handoff (one output
        token), the pending handoffs of the decode worker it was routed to."""
        if w.role == DECODE:
            w.running_requests -= 1
        elif rec["decode"] is not None:
            self.by_id[rec["decode"]].pending_handoffs -= 1

    def _record(self, i: int) -> dict[str, Any]:
        """The record of request ``i``, which has been routed (it has one)."""
        rec = self.rec[i]
        if rec is None:
            raise RuntimeError(f"request {i} has no record: it was never routed")
        return rec

    # -- closed loop -------------------------------------------------------------------
    def _park(self, i: int) -> bool:
        """Park request ``i`` on the first request it waits for that has not finished."""
        for d in self.reqs[i].deps():
            prev = self.rec[d]
            if prev is None or prev["done_t"] is None:
                self._parked.setdefault(d, []).append(i)
                return True
        return False

    def _release(self, now: float, i: int) -> None:
        for j in self._parked.pop(i, ()):
            if self._park(j):
                continue
            r = self.reqs[j]
            self.at(max(now + r.think_s, r.arrival_s), self._arrive, j, True)

    def _handoff(self, now: float, w: _Inst, i: int) -> None:
        """The KV of a held prefill goes to its decode engine (``export_kv`` + the import of
        ``add_decode_request``, in process: :meth:`Engine.import_held`), then is released."""
        d = self.by_id[self._record(i)["decode"]]
        d.engine.import_held(w.engine, str(i), SamplingParams(max_tokens=self.reqs[i].output_tokens, ignore_eos=True))
        d.pending_handoffs -= 1
        d.running_requests += 1
        w.engine.release(str(i))
        self._kick(now, d)

    # -- results -----------------------------------------------------------------------
    def busy_s(self) -> dict[str, float]:
        return {w.wid: w.busy_s for w in self.insts}
