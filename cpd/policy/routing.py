"""Cache-aware routing policy (docs/architecture.md): pure code, no I/O, no clock, no threads.

The live router (``cpd.router``) and the simulator (``cpd.sim``) import this very
module. Inputs are snapshots; the output is a :class:`RouteDecision` value.

Common to both modes:

1. For each candidate prefill-side worker ``w``, the usable cached prefix is the
   longest leading run of blocks found in ``w``'s L1, ``w``'s L2 or the global L3
   (visible blocks only). Blocks are taken from the nearest tier holding them:
   L1 ``[0, a)``, then L2 ``[a, b)``, then L3 ``[max(a, b), c)``.
2. Load versus recompute (docs/architecture.md): a tier's segment is loaded only if
   ``bytes / bandwidth + overhead`` is below the modeled recompute time of those
   tokens on top of the prefix before it; otherwise that segment and everything
   after it are recomputed (a later block's KV needs the earlier ones).

Static mode (``RoutingMode.STATIC``, the published CPD rule):

3. Reuse ratio = best usable cached tokens over all candidates / prompt tokens.
   ``cold`` if below ``cold_threshold`` (default 0.5), else ``warm``.
4. ``cpd`` topology: cold → pre-prefill pool, warm → prefill pool (isolation).
   ``pd`` topology: everything → prefill pool. An empty pool falls back to the other.
5. Within the pool, pick the worker with the smallest *score*: the estimated TTFT (queued
   prefill time, the sum of per-request estimates when the caller tracks it, + load time +
   compute time of the uncached suffix) plus ``waste_weight`` times the request's *extra work*
   there, its own work minus the smallest own work of any candidate (ties: fewer running
   requests, then worker id). This mirrors Dynamo's KV router cost (overlap credit vs load)
   expressed in seconds. The extra work is the prefix a worker recomputes because it does not
   hold it: it delays this request once (in its TTFT) and everything queued after it there
   again, so choosing on TTFT alone moves a session's turn off its prefix holder for a gain
   smaller than the capacity it wastes. Each move leaves the session's prefix split over two
   workers, so its next turns move too (``pd`` on the modeled-ordering workload near its knee:
   19 turns moved, +20.6 % computed prompt tokens, goodput 0.63 live vs the simulator's 0.91;
   docs/results/modeled_ordering). With ``waste_weight`` 1 a holder loses a turn only when its
   queue is longer by more than twice the extra work.
6. Decode worker: fewest requests *assigned* to it (``running_requests + pending_handoffs``: the
   ones decoding there and the ones routed there whose prefill or KV handoff is still under way),
   then lowest KV use, then id. Every handoff stalls its decode worker's running batch while the
   KV arrives (a 100 K-token prompt of the simulator's reference model: ~0.16 s, three TPOTs), so
   the requests routed while their prefills run must spread over the decode pool before their KV
   lands; counted only once decoding, a burst saw equal counts and went to one worker, and the
   workers' unequal handoff counts set the TPOT p90 of a decode-bound cluster
   (docs/sim_results/adaptive_grid/README.md, section 1).
   *Prefix affinity* (``decode_affinity_margin`` >= 0): the handoff import reuses the blocks the
   decode worker already holds in L1 and moves only the rest, so a decode worker whose L1 holds
   at least ``DECODE_AFFINITY_MIN_SHARE`` (half) of the prompt more than the least-loaded worker
   (the choice above) holds wins instead, if taking the request leaves it at most
   ``decode_affinity_margin`` assigned requests above the least-loaded one; among several, the
   longest L1 prefix, then the order above. The margin (default 2) is the cost model's trade:
   a saved import of a 100 K-token prompt stalls the batch ~0.16 s (FP8 KV of the reference
   model over one NIC) once, and each extra 100 K-token sequence lengthens every step ~1 ms
   (its KV read), ~0.1 s over a 100-token answer; so one saved import pays for ~1.5 extra
   sequences and shrinks the decode pool's total import work, while a margin of 25 % of
   ``max_num_seqs`` (6 of 24) could cost ~0.6 s, four imports. Without a holder
   (or ``decode_affinity_margin`` < 0) the choice is the least-loaded one, unchanged.

Adaptive mode (``RoutingMode.ADAPTIVE``, issue 11): route on *remaining work*, not on the reuse
ratio. Sources: llm-d routes follow-ups by their uncached tokens to a short-work prefill pool;
Dynamo skips remote prefill when the effective input is short; PPD (ICML 2026) appends short
turn-2+ prefills on the decode worker that holds the KV; SGLang's gateway picks among prefix
holders by their queued uncached tokens. Here all of them are one estimate, in seconds:

A1. Every healthy prefill-side worker of *both* pools is a candidate. Its load plan (rules 1-2,
    including L2/L3 loads on workers that do not hold the prefix, so a hot prefix whose holder is
    saturated spreads to workers that load it) gives ``own_s`` = loads + compute of the uncached
    suffix; ``wait_s`` = its queued work (``queued_prefill_s``, else the queued tokens priced as one
    sequence); ``ttft_s = wait_s + own_s``; ``delay_to_others_s = own_s`` (FCFS: what runs after it
    there waits that much longer). Within a pool the smallest ``score`` wins: ``ttft_s`` + the
    extra-work term of rule 5 (ties: fewer running requests, then worker id); pools are compared
    on the chosen workers' ``ttft_s`` (A3, A4).
A2. Class by remaining work: *heavy* (``cold``) when the smallest ``own_s`` exceeds
    ``heavy_uncached_s`` (default ``HEAVY_SLO_SHARE * ttft_slo_s`` = a quarter of the SLO), else
    *short* (``warm``). The bound is set by what a request does to the short work queued behind
    it, not by whether it meets the SLO itself: a FCFS queue's wait grows with the mean *square*
    of its work (Pollaczek-Khinchine), so a few requests well under the SLO but many times the
    short work set the short pool's waits near saturation (see :data:`HEAVY_SLO_SHARE`). Home pool: heavy → pre-prefill (it blocks nobody there), short → prefill; ``pd``
    topology: the prefill pool only, no spill (it still gains the remaining-work scoring).
A3. Spill-over with hysteresis. Short work goes where it finishes first: the other pool's best
    worker wins (``spill-warm``) when its ``ttft_s`` beats the home pool's best by more than
    ``spill_margin`` (relative), so an idle pre-prefill worker takes short work as soon as the
    prefill pool has a queue. The margin is a price in the request's own TTFT, paid to keep the
    pre-prefill pool clear for heavy work; it is paid only while the home pool's best meets
    ``ttft_slo_s``: once that misses, short work goes to the other pool's best whenever it is
    faster at all (``spill-warm``, no margin). (A relative margin on a TTFT that includes the queue
    tolerates an imbalance that grows with the queue: at a 2 s SLO and a 2.4 s home prediction it
    held short work home against a 1.9 s alternative; on the modeled-ordering workload, 10 seeds x
    3, 4.5, 6 QPS, adaptive was below pd-l3 at 14 of 30 points, summed goodput 20.70 vs 21.16;
    with this rule 21.15, docs/sim_results/adaptive_grid/spill_past_slo/.) Heavy work stays home
    (``home``) while the home pool's best *meets* ``ttft_slo_s`` with the estimate's error allowed
    for: predicted at most ``SLO_PREDICTION_SHARE * ttft_slo_s``, three quarters (isolation costs
    nothing then; held home at a prediction just under the SLO, a heavy request missed it one time
    in four while an idle prefill worker offered half, :data:`SLO_PREDICTION_SHARE`), and keeps
    the margin (its spill delays the prefill pool's short work); past that it spills
    (``spill-cold``) to a prefill worker that beats the home's best by more than ``spill_margin``
    and after which short work still starts within the SLO somewhere in the prefill pool (its smallest queue,
    this request included, ≤ ``ttft_slo_s``; a request whose own work exceeds the SLO misses it
    anywhere and spills only to a prefill worker with nothing queued, once home would make it
    wait more than ``HOPELESS_WAIT_FACTOR`` times its own work), and only while it is expected to
    push less than one short request past the SLO (a spill saves at most the heavy request
    itself). A pool's misses behind a queue (:func:`_misses_behind`): its measured arrivals
    (``short_arrivals_per_s``, for a heavy spill; + ``heavy_arrivals_per_s`` for a short move,
    below; summed) times the time its smallest queue stays above what an arrival can wait and
    still meet the SLO with the estimate's error allowed for (``SLO_PREDICTION_SHARE *
    ttft_slo_s`` minus the mean dispatch estimate), the excess draining at ``1 - busy`` seconds per
    second while that work keeps arriving. The same price moves short work the other way: a short
    request whose home pool's best would keep it (by the margin) goes to the pre-prefill pool's
    best where its expected misses there, its own on the plain SLO plus those its work causes
    (with it minus without, :func:`_misses_caused`), are fewer than home's
    (:func:`_expected_misses`), if it is *large*: its own work above ``LARGE_SHORT_FACTOR`` (2)
    times the mean estimate of home's dispatches (a short prompt many times the short mean leaves
    a congested prefill pool; a typical turn stays). An empty home
    pool falls back to the other (``fallback``). The margin makes the choice stable: a spilled request grows the other pool's
    queue, so spilling stops before the two pools' predictions cross, and a longer home queue
    never turns a spill back home. (Why short work is not held home until it misses the SLO: on
    the simulator's reference agent workload that left the pre-prefill worker idle and sustained
    0.96 QPS/GPU at a 0.5 s SLO without cold traffic vs 1.42 with this rule; see the issue-11
    report.)
A4. Decode-local append (``decode_append_max_tokens > 0``): a decode worker whose L1 holds the
    prefix, with an uncached suffix of at most ``decode_append_max_tokens`` whose compute
    (``prefill_time_s(suffix, cached)``), added to the appends already queued there
    (``queued_prefill_s``: the scheduler may run them in the same step), is at most
    ``DECODE_APPEND_TPOT_SHARE * tpot_slo_s`` (its running batch waits that long for one token;
    the rest of the TPOT budget is the batch's own decode step), wins when its ``ttft_s`` (its queued appends + the append) beats the prefill-side
    winner's, which moreover still owes a KV handoff (``decode-append``: pool ``decode``, prefill
    worker = decode worker, load plan = its L1 blocks).
A5. Read-after-write (``raw_wait_max_s > 0``): when blocks being written through right now extend
    the visible L3 run beyond what the decision loads, decide again as if they were visible; if
    that decision's TTFT plus the wait for them (``l3_pending_ready_s`` ≤ ``raw_wait_max_s``, added
    to the queue, not overlapped with it) is smaller, hold the dispatch ``wait_for_l3_s`` and load
    them from L3 (``wait-for-l3``); otherwise recompute.
A6. Admission (``admission_factor`` set): when every candidate's ``ttft_s`` exceeds
    ``admission_factor * max(ttft_slo_s, own_s)`` raise :class:`Overloaded` with
    ``retry_after_s = ttft_s - max(ttft_slo_s, own_s)`` of the best candidate (the queued work to
    drain before it would meet its SLO, no new arrivals). A request too large for the SLO even on
    an idle worker is judged against its own work, so size alone never rejects it.
A7. Write-through: ``cfg.resolved_write_through()`` (default ``all`` in adaptive mode): ``all`` →
    every request, ``cold`` → heavy requests, wherever they run.
A8. Decode worker: rule 6 (:func:`pick_decode`), except the decode-local append's own worker.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

from cpd.types import PREFILL_SIDE_ROLES, RequestClass, Role, RoutingMode, Tier, Topology, WriteThrough, _StrEnum

ROLE_PRE_PREFILL = Role.PRE_PREFILL
ROLE_PREFILL = Role.PREFILL
ROLE_DECODE = Role.DECODE
TIERS = tuple(Tier)


class CostModel(Protocol):
    """What the policy needs to know about compute and transfers (seconds, bytes)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token (all layers, K and V); read-only, so frozen models satisfy it."""
        ...

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        """Time to compute ``num_new_tokens`` on top of ``num_cached_tokens`` of prefix."""
        ...

    def load_time_s(self, tier: Tier, num_bytes: int) -> float:
        """Time to load ``num_bytes`` of KV from ``tier`` (``"L2"`` or ``"L3"``); L1 is free."""
        ...


@dataclass(frozen=True)
class WorkerLoad:
    """Load snapshot of one worker.

    Attributes:
        worker_id: unique id.
        role: ``pre-prefill`` | ``prefill`` | ``decode``.
        queued_prefill_tokens: prompt tokens waiting or in progress (not yet computed).
        running_requests: requests admitted and not finished.
        kv_usage: fraction of the L1 pool in use, in [0, 1].
        healthy: False excludes the worker.
        queued_prefill_s: if known, the sum of the queued requests' own prefill estimates
            (seconds). Without it the queue is priced as ``prefill_time_s(queued_prefill_tokens, 0)``,
            one long sequence, which overstates queues under a cost model with an attention term.
        pending_handoffs: decode workers: requests routed here whose decode has not started yet
            (their prefill runs on a prefill-side worker, or their KV is on its way); they will
            join this worker's batch, so the decode choice (rule 6) counts them.
        short_arrivals_per_s: prefill-side workers: short (``warm``) requests the caller dispatched
            to this worker per second over its recent window (:class:`ArrivalRate`); 0 when not
            measured. Rule A3 prices moves between the pools with it (:func:`_misses_behind`).
        short_work_per_s: the same dispatches' summed own-work estimates per second (the share of
            this worker that short work occupies); 0 when not measured.
        heavy_arrivals_per_s, heavy_work_per_s: the same for heavy (``cold``) dispatches.
    """

    worker_id: str
    role: Role
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    kv_usage: float = 0.0
    healthy: bool = True
    queued_prefill_s: float | None = None
    pending_handoffs: int = 0
    short_arrivals_per_s: float = 0.0
    short_work_per_s: float = 0.0
    heavy_arrivals_per_s: float = 0.0
    heavy_work_per_s: float = 0.0


class ArrivalRate:
    """Events per second, and their work (seconds) per second, over the last ``window_s`` seconds,
    from explicit timestamps (no clock inside; non-decreasing). The live router and the simulator
    keep one per prefill-side worker for its short dispatches, each with its own estimate
    (``WorkerLoad.short_arrivals_per_s``, ``short_work_per_s``). Memory: one window of events."""

    def __init__(self, window_s: float | None = None):
        """``window_s`` None: :data:`SHORT_ARRIVAL_WINDOW_S`."""
        self.window_s = SHORT_ARRIVAL_WINDOW_S if window_s is None else window_s
        if self.window_s <= 0:
            raise ValueError("ArrivalRate: window_s must be > 0")
        self._events: deque[tuple[float, float]] = deque()
        self._work_s = 0.0

    def observe(self, now_s: float, work_s: float = 0.0) -> None:
        self._events.append((now_s, work_s))
        self._work_s += work_s
        self._trim(now_s)

    def per_s(self, now_s: float) -> float:
        self._trim(now_s)
        return len(self._events) / self.window_s

    def work_per_s(self, now_s: float) -> float:
        """Summed work of the window's events per second: the share of one worker they occupy."""
        self._trim(now_s)
        return max(0.0, self._work_s) / self.window_s if self._events else 0.0

    def _trim(self, now_s: float) -> None:
        while self._events and self._events[0][0] < now_s - self.window_s:
            self._work_s -= self._events.popleft()[1]
        if not self._events:
            self._work_s = 0.0  # no float residue of the running sum outlives its events


class DispatchRates:
    """A prefill-side worker's short and heavy dispatches over the last window, each class an
    :class:`ArrivalRate` of its own-work estimates (rule A3 reads them as ``WorkerLoad``'s
    ``short_*`` and ``heavy_*`` rates). The live router and the simulator keep one per worker."""

    def __init__(self, window_s: float | None = None):
        self.short = ArrivalRate(window_s)
        self.heavy = ArrivalRate(window_s)

    def observe(self, now_s: float, request_class: RequestClass, work_s: float) -> None:
        (self.short if request_class == RequestClass.WARM else self.heavy).observe(now_s, work_s)

    def load_fields(self, now_s: float) -> dict[str, float]:
        """``short_arrivals_per_s``, ``short_work_per_s``, ``heavy_arrivals_per_s``,
        ``heavy_work_per_s`` at ``now_s`` (keyword arguments of :class:`WorkerLoad`)."""
        return {"short_arrivals_per_s": self.short.per_s(now_s), "short_work_per_s": self.short.work_per_s(now_s),
                "heavy_arrivals_per_s": self.heavy.per_s(now_s), "heavy_work_per_s": self.heavy.work_per_s(now_s)}


@dataclass(frozen=True)
class PrefixMatch:
    """Blocks of the request held per tier (visible blocks only), matched in the engine's
    load order: a worker's L1 run from block 0, then its L2 run continuing from there, then
    the L3 run continuing from there.

    Attributes:
        l1: worker_id → leading blocks in that worker's L1.
        l2: worker_id → end of the L2 run that continues the worker's L1 run (blocks
            ``[l1, l2)`` are in its L2; an L2 run from block 0 is the case ``l1 == 0``).
        l3: leading blocks visible in the shared L3 store (for workers with no local run).
        l3_after: worker_id → end of the L3 run that continues that worker's L1/L2 run
            (absent: no L3 blocks after it, or ``l3`` applies).
        l3_pending: end of the run of blocks, continuing the visible L3 run, that an in-flight
            prefill is writing through right now (0: none); read-after-write (issue 11 §5).
        l3_pending_ready_s: predicted seconds until those pending blocks are visible in L3.
    """

    l1: Mapping[str, int] = field(default_factory=dict)
    l2: Mapping[str, int] = field(default_factory=dict)
    l3: int = 0
    l3_after: Mapping[str, int] = field(default_factory=dict)
    l3_pending: int = 0
    l3_pending_ready_s: float = 0.0


@dataclass(frozen=True)
class RoutingConfig:
    """Routing settings (one truth: ``router.*`` of :mod:`cpd.config` builds it live; the simulator's
    experiment files build it there).

    Attributes:
        topology: cpd (pre-prefill + prefill pools) or pd (prefill pool only).
        cold_threshold: static mode: reuse ratio below which a request is cold.
        block_size: tokens per KV block.
        mode: static (reuse ratio -> fixed pool) or adaptive (remaining-work estimates).
        write_through: which prefills write their blocks through to L3 (None: the default,
            pd -> none, cpd static -> cold, cpd adaptive -> all; :meth:`resolved_write_through`).
        ttft_slo_s / tpot_slo_s: the SLOs the adaptive rules aim at.
        heavy_uncached_s: adaptive: a request whose uncached work (load + compute on its best
            worker, no queue) exceeds this is heavy ("cold"); None -> ``HEAVY_SLO_SHARE * ttft_slo_s`` (a quarter).
        spill_margin: adaptive: relative TTFT gain a worker outside the home pool must offer
            before work spills to it (hysteresis against flapping); short work pays it only while
            its home pool's best meets ``ttft_slo_s`` (rule A3).
        admission_factor: reject (429) when every candidate's predicted TTFT exceeds
            ``admission_factor * ttft_slo_s``; None -> admit everything.
        decode_append_max_tokens: decode-local append of at most this many uncached tokens
            on a decode worker holding the prefix in L1 (0 -> off).
        raw_wait_max_s: read-after-write: the longest wait for pending L3 blocks (0 -> never wait).
        decode_affinity_margin: rule 6: the most assigned requests by which a decode worker holding
            the prompt's prefix in L1 may exceed the least-loaded one after taking the request
            (< 0 -> no prefix affinity: the least-loaded worker always).
        waste_weight: rule 5 / A1: weight of a candidate's extra work (own work above the cheapest
            candidate's) added to its TTFT when choosing within a pool (0 -> smallest TTFT).
    """

    topology: Topology = Topology.CPD
    cold_threshold: float = 0.5
    block_size: int = 16
    mode: RoutingMode = RoutingMode.STATIC
    write_through: WriteThrough | None = None
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    heavy_uncached_s: float | None = None
    spill_margin: float = 0.25
    admission_factor: float | None = None
    decode_append_max_tokens: int = 0
    raw_wait_max_s: float = 0.0
    decode_affinity_margin: int = 2
    waste_weight: float = 1.0

    def resolved_write_through(self) -> WriteThrough:
        """``write_through`` with the default filled in: ``pd`` → none; ``cpd`` static → cold (the
        published rule: pre-prefill writes what prefill workers will load); ``cpd`` adaptive →
        all: adaptive routing moves a session's turns between workers and pools, so a turn
        computed on one worker must be in L3 for the next turn on another (on the modeled-ordering
        workload, docs/results/modeled_ordering, adaptive with cold-only write-through had an L3
        hit ratio of 0.01 and lost to pd; with all it beat pd-l3; on the grid's reference cells
        the two were equal)."""
        if self.write_through is not None:
            return self.write_through
        if self.topology != Topology.CPD:
            return WriteThrough.NONE
        return WriteThrough.ALL if self.mode == RoutingMode.ADAPTIVE else WriteThrough.COLD


@dataclass(frozen=True)
class LoadPlan:
    """Which leading blocks come from which tier; the rest is recomputed.

    ``l1_blocks + l2_blocks + l3_blocks`` leading blocks are loaded, in that order.
    """

    l1_blocks: int = 0
    l2_blocks: int = 0
    l3_blocks: int = 0

    @property
    def num_cached_blocks(self) -> int:
        return self.l1_blocks + self.l2_blocks + self.l3_blocks


@dataclass(frozen=True)
class Recompute:
    """The load-versus-recompute outcome that recomputes: ``num_blocks`` cached blocks of
    ``tier`` (and every block after them) are recomputed instead of loaded, because loading them
    would take longer."""

    tier: Tier
    num_blocks: int

    @property
    def reason(self) -> str:
        return f"recompute-{self.tier}:{self.num_blocks}blk"


class DecisionReason(_StrEnum):
    """Why the winner won (metrics label ``reason``; one value per decision)."""

    STATIC = "static"                  # static mode: the class's pool
    FALLBACK = "fallback"              # the class's pool had no healthy worker
    HOME = "home"                      # adaptive: the home pool's best worker
    SPILL_COLD = "spill-cold"          # adaptive: heavy work on a prefill worker
    SPILL_WARM = "spill-warm"          # adaptive: short work on a pre-prefill worker
    DECODE_APPEND = "decode-append"    # adaptive: prefilled on the decode worker holding the prefix
    WAIT_FOR_L3 = "wait-for-l3"        # adaptive: waits for pending write-through blocks


@dataclass(frozen=True)
class CandidateEstimate:
    """The policy's estimate for one candidate worker (shown in ``/cpd/requests``).

    Attributes:
        worker_id / role: the candidate.
        wait_s: queued work ahead of this request there (seconds).
        own_s: this request's load + compute there, without queue (seconds).
        ttft_s: ``wait_s + own_s``.
        delay_to_others_s: the delay this request would add to work that runs there after it
            (adaptive; 0 where not computed).
        score: what the rule minimised (lower wins).
    """

    worker_id: str
    role: Role
    wait_s: float
    own_s: float
    ttft_s: float
    delay_to_others_s: float = 0.0
    score: float = 0.0


@dataclass(frozen=True)
class RouteDecision:
    """Output of :func:`route`.

    Attributes:
        request_class: cold or warm.
        pool: role of the chosen prefill-side pool.
        prefill_worker / decode_worker: chosen worker ids (decode may be None if no decode pool).
        load_plan: prefix blocks to load per tier on the chosen worker.
        reuse_ratio: best usable cached tokens / prompt tokens, in [0, 1].
        estimated_ttft_s: the policy's estimate for the chosen worker.
        write_through: the chosen worker writes the computed blocks through to L3.
        reason: why the winner won (:class:`DecisionReason`).
        candidates: the estimates of every candidate considered (explainability).
        wait_for_l3_s: read-after-write: hold the dispatch up to this long for pending L3
            blocks (0: dispatch now).
        recompute: on the chosen worker, the cached tier segment recomputed instead of loaded
            (None: every cached block it can use is loaded).
        fallback_from: the pool the class asked for when it had no healthy worker (None: it had).
        reasons: (derived) short strings for logs and ``/cpd/requests``; control flow and
            metrics use the typed fields above.
    """

    request_class: RequestClass
    pool: Role
    prefill_worker: str
    decode_worker: str | None
    load_plan: LoadPlan
    reuse_ratio: float
    estimated_ttft_s: float
    recompute: Recompute | None = None
    fallback_from: Role | None = None
    write_through: bool = False
    reason: DecisionReason = DecisionReason.STATIC
    candidates: tuple[CandidateEstimate, ...] = ()
    wait_for_l3_s: float = 0.0

    @property
    def decode_append(self) -> bool:
        """True when the request is prefilled on its decode worker (no handoff): ``pool`` is
        ``decode`` and ``prefill_worker == decode_worker``."""
        return self.pool == Role.DECODE

    @property
    def reasons(self) -> tuple[str, ...]:
        out = [f"{self.request_class}:reuse={self.reuse_ratio:.2f}"]
        if self.reason not in (DecisionReason.STATIC, DecisionReason.FALLBACK):
            out.append(str(self.reason))
        if self.fallback_from is not None:
            out.append(f"fallback:no-{self.fallback_from}")
        if self.recompute is not None:
            out.append(self.recompute.reason)
        return tuple(out)


class NoWorkerError(RuntimeError):
    """No healthy worker can take the request (the router answers 503)."""


class Overloaded(RuntimeError):
    """SLO-predictive admission: every candidate's predicted TTFT exceeds
    ``admission_factor * ttft_slo_s`` (the router answers 429 with ``Retry-After``)."""

    def __init__(self, predicted_ttft_s: float, retry_after_s: float):
        super().__init__(f"predicted TTFT {predicted_ttft_s:.2f} s exceeds the admission bound")
        self.predicted_ttft_s = predicted_ttft_s
        self.retry_after_s = retry_after_s


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """The most leading blocks of a prompt a request takes from any cache: at least one prompt
    token is always computed, to produce the first output token's logits (the engine's rule)."""
    return max(0, (num_prompt_tokens - 1) // block_size)


def plan_loads(worker_id: str, match: PrefixMatch, num_prompt_tokens: int, cfg: RoutingConfig,
               cost: CostModel) -> tuple[LoadPlan, Recompute | None]:
    """Load plan for one worker after the load-versus-recompute check, and the segment it
    recomputes instead of loading (None if none).

    At most :func:`max_cached_blocks` blocks are loaded.
    """
    bs = cfg.block_size
    cap = max_cached_blocks(num_prompt_tokens, bs)
    a = min(match.l1.get(worker_id, 0), cap)
    b = min(match.l2.get(worker_id, 0), cap)
    c = min(max(match.l3, match.l3_after.get(worker_id, 0)), cap)
    recompute: Recompute | None = None
    segments = [(Tier.L1, 0, a), (Tier.L2, a, max(a, b)), (Tier.L3, max(a, b), max(a, b, c))]
    loaded = {Tier.L1: 0, Tier.L2: 0, Tier.L3: 0}
    for tier, lo, hi in segments:
        n = hi - lo
        if n <= 0:
            continue
        if tier != Tier.L1:
            t_load = cost.load_time_s(tier, n * bs * cost.kv_bytes_per_token)
            t_comp = cost.prefill_time_s(n * bs, lo * bs)
            if t_load >= t_comp:
                recompute = Recompute(tier, n)
                break
        loaded[tier] = n
    return LoadPlan(loaded[Tier.L1], loaded[Tier.L2], loaded[Tier.L3]), recompute


DECODE_AFFINITY_MIN_SHARE = 0.5
"""Rule 6 prefix affinity: a decode worker's L1 must hold at least this share of the prompt more than
the least-loaded worker's does: a shared system prompt held everywhere, or a few blocks more, never
outweigh the load order."""


def _assigned(w: WorkerLoad) -> int:
    return w.running_requests + w.pending_handoffs


def pick_decode(loads: Sequence[WorkerLoad], match: PrefixMatch | None = None, num_prompt_tokens: int = 0,
                cfg: RoutingConfig | None = None) -> str | None:
    """The decode worker for a request (rule 6): fewest assigned requests (``running_requests +
    pending_handoffs``: handoffs still under way join the batch soon, and each stalls it while
    its KV arrives), then lowest KV use, then id; but a worker whose L1 (``match.l1``) holds at
    least ``DECODE_AFFINITY_MIN_SHARE`` of the ``num_prompt_tokens``-token prompt more than that
    one wins when, with the request, it has at most ``cfg.decode_affinity_margin`` assigned
    requests more (longest L1 prefix first, then the same order). None when no decode worker is
    healthy. Also the dispatcher's choice on a retry. Without ``match`` or ``cfg``: load only."""
    ds = [w for w in loads if w.role == ROLE_DECODE and w.healthy]
    if not ds:
        return None
    least = min(ds, key=lambda w: (_assigned(w), w.kv_usage, w.worker_id))
    if match is None or cfg is None or cfg.decode_affinity_margin < 0 or not match.l1:
        return least.worker_id
    base = match.l1.get(least.worker_id, 0)
    need_blocks = DECODE_AFFINITY_MIN_SHARE * num_prompt_tokens / cfg.block_size
    holders = [w for w in ds if match.l1.get(w.worker_id, 0) - base >= max(1.0, need_blocks)
               and _assigned(w) + 1 - _assigned(least) <= cfg.decode_affinity_margin]
    if not holders:
        return least.worker_id
    return min(holders, key=lambda w: (-match.l1.get(w.worker_id, 0), _assigned(w), w.kv_usage,
                                       w.worker_id)).worker_id


def route(num_prompt_tokens: int, match: PrefixMatch, loads: Sequence[WorkerLoad], cfg: RoutingConfig,
          cost: CostModel) -> RouteDecision:
    """Choose pool, prefill-side worker, load plan and decode worker for one request.

    ``cfg.mode`` static: rules 1-6 of the module docstring; adaptive: rules A1-A8.

    Args:
        num_prompt_tokens: prompt length (>= 1).
        match: per-tier leading-block matches of the request's block hashes.
        loads: one snapshot per worker.
        cfg: topology and thresholds.
        cost: cost model (the live router's is measured; the simulator's is a roofline).
    Raises:
        NoWorkerError: no healthy prefill-side worker.
        Overloaded: adaptive admission (``cfg.admission_factor`` set) rejects the request.
    """
    prefill_side = [w for w in loads if w.healthy and w.role in PREFILL_SIDE_ROLES]
    if not prefill_side:
        raise NoWorkerError("no healthy prefill or pre-prefill worker")
    if cfg.mode == RoutingMode.ADAPTIVE:
        return _route_adaptive(num_prompt_tokens, match, loads, prefill_side, cfg, cost)
    return _route_static(num_prompt_tokens, match, loads, prefill_side, cfg, cost)


def _route_static(num_prompt_tokens: int, match: PrefixMatch, loads: Sequence[WorkerLoad],
                  prefill_side: Sequence[WorkerLoad], cfg: RoutingConfig, cost: CostModel) -> RouteDecision:
    """Static mode (rules 1-6): reuse ratio -> the class's pool, the smallest estimated TTFT in it."""
    plans = {w.worker_id: plan_loads(w.worker_id, match, num_prompt_tokens, cfg, cost) for w in prefill_side}
    best_cached = max(p.num_cached_blocks for p, _ in plans.values()) * cfg.block_size
    reuse = min(1.0, best_cached / max(1, num_prompt_tokens))
    cls = RequestClass.WARM if reuse >= cfg.cold_threshold else RequestClass.COLD
    want = Role.PRE_PREFILL if (cfg.topology == Topology.CPD and cls == RequestClass.COLD) else Role.PREFILL
    pool = [w for w in prefill_side if w.role == want]
    fallback_from = None
    if not pool:
        fallback_from = want
        pool = list(prefill_side)
    own = {w.worker_id: work_s(plans[w.worker_id][0], num_prompt_tokens, cfg, cost) for w in prefill_side}
    least_own = min(own.values())
    scored = []
    for w in pool:
        wait = _queue_s(w, cost)
        t = wait + own[w.worker_id]
        score = t + cfg.waste_weight * (own[w.worker_id] - least_own)
        scored.append((score, w.running_requests, w.worker_id, Role(w.role), wait, t))
    _, _, wid, role, _, t = min(scored)
    wt = cfg.resolved_write_through()
    write = wt == WriteThrough.ALL or (wt == WriteThrough.COLD and cls == RequestClass.COLD)
    cands = tuple(CandidateEstimate(w_id, r, wait, own[w_id], ts, score=score)
                  for score, _, w_id, r, wait, ts in scored)
    return RouteDecision(cls, role, wid, pick_decode(loads, match, num_prompt_tokens, cfg), plans[wid][0], reuse, t,
                         recompute=plans[wid][1], fallback_from=fallback_from, write_through=write,
                         reason=DecisionReason.FALLBACK if fallback_from is not None else DecisionReason.STATIC,
                         candidates=cands)


# -- adaptive mode (issue 11) -------------------------------------------------------------------

HEAVY_SLO_SHARE = 0.25
"""Default heavy threshold (A2) as a share of ``ttft_slo_s`` (``RoutingConfig.heavy_uncached_s`` None).
Half the SLO (the earlier default) bounded what one request alone does to short work behind it on
an empty queue; near saturation the short pool always has a queue, and its wait grows with the
mean square of the work in it, so requests just under half the SLO set everyone's TTFT. On the
simulator's reference agent workload at a 2 s SLO (cold 3 %, output 100, seed 2) the compacted
sessions' first turns (44 K tokens, 0.68 s of own work, 9 % of the requests) were short under
half the SLO; on the prefill worker they were 12 % of the requests, half of the work and three
quarters of the squared work (at 1.0 QPS/GPU): warm TTFT p90 1.98 s vs
0.43 s under static isolation, adaptive 0.913 vs cpd-static's 1.027 QPS/GPU; with a quarter,
1.029 (seeds 1-3: 1.040, 1.029, 1.107 vs best other 1.044, 1.027, 1.105;
docs/sim_results/adaptive_grid/medium_work/). On that workload nothing lies between a quarter
and half of the 1 s and 0.5 s SLOs, so only the 2 s cells change there. (A quarter was the
default once before, with an older heavy spill rule and simulator core, and held too much work
on the pre-prefill worker: 1.27 vs 1.57 QPS/GPU at 3 % cold, 2 s; since then heavy work spills
once its home misses the SLO, rule A3.)"""

SLO_PREDICTION_SHARE = 0.75
"""Rule A3: heavy work's home pool *meets* ``ttft_slo_s`` (and the heavy request stays there) only
when its best predicted TTFT is at most this share of it. The prediction (queued estimates + own
work, a linear cost model) is not the TTFT: on the modeled-ordering workload (simulator, 10 seeds
x 3, 4.5, 6 QPS, adaptive), over the requests predicted at 0.5-1 x the SLO, actual / predicted
TTFT had a median of 0.95-1.02, a p90 of 1.21-1.25 and a p95 of 1.24-1.34 (chunked prefill shares
steps, the linear model has no attention term); 1 / 0.75 = 1.33 covers that p95. Taken at face
value (a share of 1), a prediction at 0.9-1.0 x the SLO met it about three times in four: heavy
requests held home there missed 8 of 31, 22 of the 31 with the prefill pool's best (often an
idle worker) under three quarters of home's. Adaptive was below the best P/D configuration at 4
of 30 points, by 9 requests; 4 of them were such heavy requests and 3 more followed one of them
in a burst. With 0.75: summed goodput 24.88 -> 24.95 (pd-l3 20.85), below the best P/D at 2
points by 1 request each, above at 20; Mooncake conversation trace (TTFT 1 s, seeds 1-3)
saturation within 0.2 %. Short work's margin (:func:`_spill_margin`) keeps the plain
SLO test: with this allowance there too the modeled-ordering sum was 25.02 (1 point below), but
the decode-bound agent cell (cold 0, TTFT 1 s) lost 0.06-0.4 % and fell below pd-l3 at 3 of 3
seeds instead of 1; with the heavy rule alone that cell and the two cold-0.08 cells are
unchanged (docs/sim_results/adaptive_grid/below_pd_points/)."""

HOPELESS_WAIT_FACTOR = 2.0
"""A3: a heavy request whose own work exceeds the SLO spills to an idle prefill worker only once
home would make it wait more than this many times its own work (its TTFT at home is then more than
3x its own work). By the estimate such a request misses the SLO anywhere, so a spill gains it no
goodput and delays short work; letting it spill to any idle prefill worker (a factor of 0) cost
adaptive 7.7 % on one seed of the simulator's reference cell (cold 0.08, TTFT 1 s: 0.700 -> 0.646
QPS/GPU, before the price below), and with the price 23 % on the agent cell cold 0.15 / TTFT 1 s /
output 400, seed 1 (0.2613 -> 0.2000).
The factor alone still let such a request onto the only prefill worker while short work kept
arriving there: on the Claude Code sessions (TTFT 0.5 s, seed 2, 4.0 QPS/GPU) the spills of
1.0-1.8 s prompts past a 2-13 s pre-prefill queue held the only prefill worker while short work
arrived at ~12/s (38 of the 39 requests adaptive lost to cpd-static were short ones there; goodput
0.880 vs 0.911); so the spill also needs the short work it is expected to
push past the SLO to be under one request (the price of :func:`_heavy_spill_pays`): 0.925 there, and no
Claude Code search rerun below 1.03 of the best other (docs/sim_results/adaptive_grid/a3_session16/).
It prices only the short side: a refused spill also keeps its work in the pre-prefill queue ahead of
heavy requests that could still meet the SLO (Claude Code seed 1, output 400: 1.9 % under the figure
without the price at TTFT 2 s, still 1.04 of the best other; the 2.7 % it cost at 1 s came back with
the residue fix, 4.1356 -> 4.2429 QPS/GPU). The estimate is not the request's time: a router cost
model fitted to warm turns (the simulator's ``linear`` one before session 18, now ``linear-flat``:
one rate, each token priced as attending to ~100 K tokens of context; since then the router prices
in the architecture's shape, :func:`prefill_work_tokens`, and the seed-3 cell below gives 0.4683,
0.964 of pd-l3, docs/sim_results/adaptive_grid/session18/) prices a cold prompt computed from
scratch at 1.5-3x its compute, so
a 75-95 K-token prompt priced at 1.2-1.5 s takes 0.6-0.9 s on an idle worker and meets a 1 s SLO
there. At the earlier factor of 4 such prompts waited at home behind one other cold prompt and
missed while the prefill worker idled (agent cell
cold 0.15 / TTFT 1 s / output 400, seed 3: 0.932 of pd-l3). With 2 (after the residue fix,
:data:`QUEUE_RESOLUTION_S`): that seed 0.4525 -> 0.4621 QPS/GPU (0.951), cold 0.03 / 0.5 s seed 1
0.5577 -> 0.6076 (0.980 -> 1.067 of pd-l3), cold 0.08 / 0.5 s seeds 1-2 +2-4 %; 12 other agent,
Claude Code and Mooncake searches equal, two lower: cold 0.03 / 0.5 s seed 3, 0.6231 -> 0.6213
(0.976), and Claude Code TTFT 1 s / output 100 seed 3, 4.8771 -> 4.7833 (1.150 -> 1.128 of
cpd-static); a factor of 1 lowered the seed-3 cell to 0.4462 (docs/sim_results/adaptive_grid/session17/)."""

MIN_DRAIN_SHARE = 0.1
"""Rule A3 (:func:`_misses_behind`): the least share of a second by which a pool's queue is taken to
drain per second when its arrivals occupy nearly all of its workers (a queue that arrivals keep
full never drains; this bounds the price at ten times the excess)."""

LARGE_SHORT_FACTOR = 2.0
"""Rule A3's priced move of short work to the pre-prefill pool (:func:`_expected_misses`) applies only
to short requests whose own work exceeds this many times the mean estimate of the home pool's
dispatches (:func:`_large_short`): a FCFS queue's wait grows with the mean square of its work, so
the requests many times the mean are the ones that hold the turns behind them, and moving a typical
turn trades its own likely SLO for the price's rough estimate of the others'. Moving any short
request by the price (no size test) cost adaptive 3-9 % on the Mooncake conversation trace at a
0.5 s TTFT SLO (1.91, 1.97, 1.91 vs 2.02, 2.16, 2.05 QPS/GPU without the move; cpd / pd 1.35 on seed 2)
and 12 % on agent cold 0.03 / 0.5 s / output 100, seed 2 (0.7167 vs 0.8158); with this factor:
Mooncake 2.02, 2.12, 2.19, that agent seed 0.8158, and the move still takes the 44 K-token prompts
(3.3x the short mean) off a congested prefill worker (agent cold 0.03 / 2 s / 100, seed 2: 1.0156
vs 0.9269 without the move; docs/sim_results/adaptive_grid/session21/)."""

MISS_RESOLUTION = 1e-9
"""Rule A3's priced short move needs fewer expected misses at the other pool by more than this: where
both pools' queues are past their bounds and the request's own work is the same on both, the two
prices are equal but for the rounding of (after - before), which must not decide (a property test
found a longer home queue turning such a move back home: 17 arrivals/s on both pools, queues 2 and
6 s). A billionth of a request is far below any price the rule acts on."""

SHORT_ARRIVAL_WINDOW_S = 10.0
"""Window of :class:`ArrivalRate` (``WorkerLoad.short_arrivals_per_s``, ``heavy_arrivals_per_s``): long enough to count the
tens of short requests per second that make a hopeless spill costly, short enough to follow the
load a spill of 1-2 s meets."""

DECODE_APPEND_TPOT_SHARE = 0.5
"""Decode-local append: the append's compute, with the appends queued before it on that decode
worker, may take at most this share of ``tpot_slo_s`` (the rest of the budget is kept for the
running batch's own decode step, which the policy does not model)."""


@dataclass(frozen=True)
class _Candidate:
    """One candidate worker with its load plan and estimate (adaptive mode)."""

    load: WorkerLoad
    plan: LoadPlan
    recompute: Recompute | None
    est: CandidateEstimate


QUEUE_RESOLUTION_S = 1e-6
"""Rule A3's hopeless spill needs a prefill worker with *nothing queued*: queued work below this
(seconds) counts as nothing. The live router and the simulator keep ``queued_prefill_s`` as a
running sum (a request's estimate added at dispatch, subtracted at its first token), which leaves
float residue on an idle worker (1.5e-16 s in the simulator's agent cell cold 0.15 / TTFT 1 s);
compared exactly, it refused the hopeless spill to any worker whose sum had left a positive
residue (docs/sim_results/adaptive_grid/session17/). A microsecond is far above the residue and far
below any prefill step. (Only this test uses it: elsewhere the residue only breaks exact ties.)"""


def _queue_s(w: WorkerLoad, cost: CostModel) -> float:
    """Queued work ahead of a new request on ``w`` (seconds): the caller's per-request sum when it
    tracks one, else the queued tokens priced as one sequence."""
    if w.queued_prefill_s is not None:
        return max(0.0, w.queued_prefill_s)
    return cost.prefill_time_s(w.queued_prefill_tokens, 0) if w.queued_prefill_tokens else 0.0


def work_s(plan: LoadPlan, num_prompt_tokens: int, cfg: RoutingConfig, cost: CostModel) -> float:
    """A request's own work on the worker that runs ``plan``: the L2/L3 loads of the plan (the engine
    runs them inside its steps, so they occupy the worker like compute) + the compute of the uncached
    suffix. The policy's ``own_s``, and what the dispatch (live and simulated) adds to the worker's
    ``queued_prefill_s`` until the first token."""
    t = 0.0
    for tier, n in ((Tier.L2, plan.l2_blocks), (Tier.L3, plan.l3_blocks)):
        if n:
            t += cost.load_time_s(tier, n * cfg.block_size * cost.kv_bytes_per_token)
    cached = plan.num_cached_blocks * cfg.block_size
    return t + cost.prefill_time_s(num_prompt_tokens - cached, cached)


def _candidate(w: WorkerLoad, match: PrefixMatch, num_prompt_tokens: int, cfg: RoutingConfig,
               cost: CostModel) -> _Candidate:
    """Estimate one prefill-side worker (rule A1). ``delay_to_others_s`` is ``own_s``: a FCFS queue
    holds everything that runs after this request there up by its own work."""
    plan, recompute = plan_loads(w.worker_id, match, num_prompt_tokens, cfg, cost)
    own, wait = work_s(plan, num_prompt_tokens, cfg, cost), _queue_s(w, cost)
    est = CandidateEstimate(w.worker_id, Role(w.role), wait, own, wait + own, delay_to_others_s=own,
                            score=wait + own)
    return _Candidate(w, plan, recompute, est)


def _scored(cands: Sequence[_Candidate], cfg: RoutingConfig) -> list[_Candidate]:
    """``cands`` with ``score`` = ``ttft_s`` + ``waste_weight`` x (``own_s`` - the least ``own_s``)
    (rule 5's extra-work term)."""
    least_own = min((c.est.own_s for c in cands), default=0.0)
    return [dataclasses.replace(c, est=dataclasses.replace(
        c.est, score=c.est.ttft_s + cfg.waste_weight * (c.est.own_s - least_own))) for c in cands]


def _best(cands: Sequence[_Candidate]) -> _Candidate:
    """Smallest score (ties: fewer running requests, then worker id)."""
    return min(cands, key=lambda c: (c.est.score, c.load.running_requests, c.load.worker_id))


def heavy_uncached_s(cfg: RoutingConfig) -> float:
    """Own work above which a request is heavy (``cold``): ``heavy_uncached_s``, else
    ``HEAVY_SLO_SHARE * ttft_slo_s``."""
    return cfg.heavy_uncached_s if cfg.heavy_uncached_s is not None else HEAVY_SLO_SHARE * cfg.ttft_slo_s


def _heavy_spill_pays(c: _Candidate, prefill_pool: Sequence[_Candidate], best_home: _Candidate,
                      cfg: RoutingConfig) -> bool:
    """Heavy work may enter the prefill pool on ``c`` only if it is expected to push less than one
    short request past the SLO there (:func:`_misses_behind` of the pool's short arrivals, with
    the pool's smallest queue after the spill, ``c``'s grown by this request's own work): a spill
    saves at most the heavy request itself, so it may cost no more. That smallest queue must
    moreover be within ``ttft_slo_s`` (short work arriving next still starts within the SLO
    somewhere in the pool).

    Priced both ways (the misses the spill causes, after minus before, over all the pool's
    arrivals, against one plus those its work would cause at home) it spilled more where home is
    congested and cost 3 agent seeds with cold work 12-23 % (cold 0.08 / 1 s / 100 seed 3: 0.7158
    vs 0.9335 QPS/GPU; cold 0.03 / 1 s / 100 seed 2: 0.8286 vs 1.0027; cold 0.03 / 0.5 s / 100 seed
    3: 0.7835 vs 0.8092) for one it gained (cold 0 / 0.5 s / 100 seed 1: 1.1808 vs 1.1339;
    docs/sim_results/adaptive_grid/session21/): the home term, amplified by a home drain near
    :data:`MIN_DRAIN_SHARE`, counts heavy arrivals that can spill themselves.

    A request whose own work alone exceeds the SLO misses it wherever it runs, so moving it
    gains no goodput and only delays short work: it stays home, unless home would make it wait
    more than :data:`HOPELESS_WAIT_FACTOR` times its own work, when it may take a prefill worker
    with nothing queued (below :data:`QUEUE_RESOLUTION_S`; short work arriving next then waits at
    most this one request), at the same price. Without that bound it stayed behind a pre-prefill
    queue of any length while a prefill worker idled (a live trial: TTFT up to 36 s, the prefill
    worker idle); with no traffic behind it (that trial) it still spills."""
    lowest = min(p.est.wait_s + (c.est.own_s if p is c else 0.0) for p in prefill_pool)
    if lowest > cfg.ttft_slo_s:
        hopeless = c.est.own_s > cfg.ttft_slo_s and best_home.est.wait_s > HOPELESS_WAIT_FACTOR * c.est.own_s \
            and lowest <= c.est.own_s + QUEUE_RESOLUTION_S
        if not hopeless:
            return False
    return _misses_behind(lowest, prefill_pool, cfg, heavy_too=False) < 1.0


def _expected_misses(c: _Candidate, pool: Sequence[_Candidate], cfg: RoutingConfig) -> float:
    """Requests expected to miss ``ttft_slo_s`` if this short one runs on ``c`` (of ``pool``): itself
    (its prediction above the plain SLO, the test its margin uses, :func:`_spill_margin`) plus the
    arrivals its work pushes past the SLO (:func:`_misses_caused`). Short work moves to the other
    pool where that is smaller, even without a faster TTFT: a short prompt of 3.3x the short mean on
    a prefill worker that short turns kept 70 % busy cost the turns behind it the SLO (agent cold
    0.03 / TTFT 2 s / output 100, seed 2, docs/sim_results/adaptive_grid/session20/)."""
    own_miss = 1.0 if c.est.ttft_s > cfg.ttft_slo_s else 0.0
    return own_miss + _misses_caused(c, pool, cfg)


def _large_short(c: _Candidate, pool: Sequence[_Candidate]) -> bool:
    """Short work on ``c`` is *large*: its own work exceeds :data:`LARGE_SHORT_FACTOR` times the mean
    estimate of the pool's measured dispatches (never where none are measured)."""
    rate, work_per_s = _arrivals(pool, heavy_too=True)
    return rate > 0.0 and c.est.own_s > LARGE_SHORT_FACTOR * work_per_s / rate


def _arrivals(pool: Sequence[_Candidate], heavy_too: bool) -> tuple[float, float]:
    """The pool's measured dispatches per second and their summed own-work estimates per second:
    short ones, plus heavy ones with ``heavy_too``."""
    rate = sum(p.load.short_arrivals_per_s + (p.load.heavy_arrivals_per_s if heavy_too else 0.0) for p in pool)
    work = sum(p.load.short_work_per_s + (p.load.heavy_work_per_s if heavy_too else 0.0) for p in pool)
    return rate, work


def _misses_caused(c: _Candidate, pool: Sequence[_Candidate], cfg: RoutingConfig) -> float:
    """The arrivals at ``pool`` that this request's own work on ``c`` pushes past the SLO: the
    expected misses behind the pool's smallest queue with it (:func:`_misses_behind`) minus those
    without it."""
    before = min(p.est.wait_s for p in pool)
    after = min(p.est.wait_s + (c.est.own_s if p is c else 0.0) for p in pool)
    return _misses_behind(after, pool, cfg) - _misses_behind(before, pool, cfg)


def _misses_behind(queue_s: float, pool: Sequence[_Candidate], cfg: RoutingConfig, heavy_too: bool = True) -> float:
    """Requests expected to arrive at ``pool`` and miss the SLO behind a smallest queue of
    ``queue_s`` (its short arrivals, and with ``heavy_too`` its heavy ones: a heavy spill is priced
    by the short work it holds, a short request's move by everyone it holds). An arrival meets the
    SLO, with the estimate's error allowed for, when the queue ahead of it is at most
    ``SLO_PREDICTION_SHARE * ttft_slo_s`` minus its own work (the mean estimate of those
    arrivals); the excess drains at ``1 - busy`` seconds per second, where ``busy`` is the share of
    a worker those arrivals occupy (the work arriving meanwhile queues too; at least
    :data:`MIN_DRAIN_SHARE`), and every one arriving meanwhile (their measured rate) misses. Without the drain and the error allowance (the queue's excess
    over the SLO alone, the rule before session 20) two 44 K-token prompts spilled onto the only
    prefill worker within their own SLO held 37 warm turns past it (agent cold 0.03 / TTFT 1 s /
    output 100, seed 2: warm turns ~60 % of that worker, the 0.9 s backlog drained at 0.4 s/s;
    docs/sim_results/adaptive_grid/session19/)."""
    rate, work_per_s = _arrivals(pool, heavy_too)
    if rate <= 0.0:
        return 0.0
    bound_s = SLO_PREDICTION_SHARE * cfg.ttft_slo_s - work_per_s / rate
    drain = max(MIN_DRAIN_SHARE, 1.0 - work_per_s / len(pool))
    return rate * max(0.0, queue_s - bound_s) / drain


def _heavy_home_meets_slo(best_home: _Candidate, cfg: RoutingConfig) -> bool:
    """Rule A3: heavy work's home pool meets ``ttft_slo_s`` with the estimate's error allowed for
    (its best predicted TTFT at most :data:`SLO_PREDICTION_SHARE` of it)."""
    return best_home.est.ttft_s <= SLO_PREDICTION_SHARE * cfg.ttft_slo_s


def _spill_margin(best_home: _Candidate, heavy: bool, cfg: RoutingConfig) -> float:
    """Rule A3's relative margin for this decision: ``spill_margin``, except for short work whose
    home pool's best misses ``ttft_slo_s`` (0: the hysteresis would cost the request the SLO it is
    meant to protect for others; heavy work keeps the margin, its spill delays short work)."""
    if not heavy and best_home.est.ttft_s > cfg.ttft_slo_s:
        return 0.0
    return cfg.spill_margin


def _choose_prefill_side(cands: Sequence[_Candidate], heavy: bool, cfg: RoutingConfig
                         ) -> tuple[_Candidate, DecisionReason, Role | None]:
    """Rules A2-A3: the home pool's best worker unless the other pool's is better by more than
    the margin (:func:`_spill_margin`; heavy work: only once home does not meet the SLO,
    :func:`_heavy_home_meets_slo`, and only where short work still fits); returns (winner, reason,
    fallback_from)."""
    home_role = Role.PRE_PREFILL if heavy and cfg.topology == Topology.CPD else Role.PREFILL
    home = [c for c in cands if c.load.role == home_role]
    other = [c for c in cands if c.load.role != home_role]
    if not home:
        return _best(other), DecisionReason.FALLBACK, home_role
    best_home = _best(home)
    if cfg.topology != Topology.CPD or not other:
        return best_home, DecisionReason.HOME, None
    if heavy:
        if _heavy_home_meets_slo(best_home, cfg):
            return best_home, DecisionReason.HOME, None
        prefill_pool = other
        other = [c for c in other if _heavy_spill_pays(c, prefill_pool, best_home, cfg)]
    if other:
        best_other = _best(other)
        if best_other.est.ttft_s < (1.0 - _spill_margin(best_home, heavy, cfg)) * best_home.est.ttft_s:
            return best_other, (DecisionReason.SPILL_COLD if heavy else DecisionReason.SPILL_WARM), None
        if not heavy and _large_short(best_home, home) \
                and _expected_misses(best_other, other, cfg) < _expected_misses(best_home, home, cfg) - MISS_RESOLUTION:
            return best_other, DecisionReason.SPILL_WARM, None
    return best_home, DecisionReason.HOME, None


def _decode_append_candidates(num_prompt_tokens: int, match: PrefixMatch, loads: Sequence[WorkerLoad],
                              cfg: RoutingConfig, cost: CostModel) -> list[_Candidate]:
    """Rule A4: decode workers holding the prefix in L1 whose append is small enough: uncached suffix
    at most ``decode_append_max_tokens`` and append compute, with the appends already queued there,
    at most ``DECODE_APPEND_TPOT_SHARE * tpot_slo_s`` (the scheduler may batch them into one step,
    for which the running batch waits; the rest of the TPOT budget is its own decode step).
    ``delay_to_others_s`` is this append's stall of the running batch."""
    if cfg.decode_append_max_tokens <= 0:
        return []
    cap = max_cached_blocks(num_prompt_tokens, cfg.block_size)
    out = []
    for w in loads:
        if not (w.healthy and w.role == Role.DECODE and match.l1.get(w.worker_id, 0) > 0):
            continue
        plan = LoadPlan(l1_blocks=min(match.l1[w.worker_id], cap))
        cached = plan.num_cached_blocks * cfg.block_size
        suffix = num_prompt_tokens - cached
        append_s, wait = cost.prefill_time_s(suffix, cached), _queue_s(w, cost)
        if suffix > cfg.decode_append_max_tokens or wait + append_s > DECODE_APPEND_TPOT_SHARE * cfg.tpot_slo_s:
            continue
        est = CandidateEstimate(w.worker_id, Role.DECODE, wait, append_s, wait + append_s,
                                delay_to_others_s=append_s, score=wait + append_s)
        out.append(_Candidate(w, plan, None, est))
    return out


def _admit(cands: Sequence[CandidateEstimate], cfg: RoutingConfig) -> None:
    """Rule A6 (``admission_factor`` set): raise :class:`Overloaded` when every candidate's predicted
    TTFT exceeds ``admission_factor * max(ttft_slo_s, own_s)``: a request too large to meet the SLO
    even on an idle worker is judged against its own work, so size alone never rejects it.
    ``retry_after_s`` (best candidate) ``= ttft_s - max(ttft_slo_s, own_s)``: the queued work that must
    drain before the request would meet its SLO there, at one second of work per second with no
    new arrivals (an estimate, not a promise)."""
    if cfg.admission_factor is None or not cands:
        return
    factor = cfg.admission_factor
    if any(c.ttft_s <= factor * max(cfg.ttft_slo_s, c.own_s) for c in cands):
        return
    best = min(cands, key=lambda c: c.ttft_s)
    raise Overloaded(best.ttft_s, best.ttft_s - max(cfg.ttft_slo_s, best.own_s))


def _adaptive_decision(num_prompt_tokens: int, match: PrefixMatch, loads: Sequence[WorkerLoad],
                       prefill_side: Sequence[WorkerLoad], cfg: RoutingConfig, cost: CostModel) -> RouteDecision:
    """Rules A1-A4, A7-A8 for one prefix match (no read-after-write, no admission)."""
    cands = _scored([_candidate(w, match, num_prompt_tokens, cfg, cost) for w in prefill_side], cfg)
    heavy = min(c.est.own_s for c in cands) > heavy_uncached_s(cfg)
    win, reason, fallback_from = _choose_prefill_side(cands, heavy, cfg)
    appends = _decode_append_candidates(num_prompt_tokens, match, loads, cfg, cost)
    decode_worker = pick_decode(loads, match, num_prompt_tokens, cfg)
    if appends and _best(appends).est.ttft_s < win.est.ttft_s:
        win, reason, fallback_from = _best(appends), DecisionReason.DECODE_APPEND, None
        heavy, decode_worker = win.est.own_s > heavy_uncached_s(cfg), win.load.worker_id
    best_cached = max(c.plan.num_cached_blocks for c in (*cands, *appends)) * cfg.block_size
    wt = cfg.resolved_write_through()
    cls = RequestClass.COLD if heavy else RequestClass.WARM
    return RouteDecision(cls, Role(win.load.role), win.load.worker_id, decode_worker, win.plan,
                         min(1.0, best_cached / max(1, num_prompt_tokens)), win.est.ttft_s,
                         recompute=win.recompute, fallback_from=fallback_from,
                         write_through=wt == WriteThrough.ALL or (wt == WriteThrough.COLD and heavy),
                         reason=reason, candidates=tuple(c.est for c in (*cands, *appends)))


def _read_after_write(d: RouteDecision, num_prompt_tokens: int, match: PrefixMatch, loads: Sequence[WorkerLoad],
                      prefill_side: Sequence[WorkerLoad], cfg: RoutingConfig, cost: CostModel) -> RouteDecision:
    """Rule A5: when pending write-through blocks extend the visible L3 run past what ``d`` loads,
    decide again as if they were visible; wait for them if that decision's TTFT plus the wait
    (``l3_pending_ready_s``, in ``(0, raw_wait_max_s]``) beats ``d``. The wait is added to the
    queue, not overlapped with it (conservative: other requests may join the queue meanwhile)."""
    ready_s = match.l3_pending_ready_s
    if (cfg.raw_wait_max_s <= 0 or not 0.0 < ready_s <= cfg.raw_wait_max_s
            or match.l3_pending <= max(match.l3, d.load_plan.num_cached_blocks)):
        return d
    seen = dataclasses.replace(match, l3=match.l3_pending, l3_pending=0, l3_pending_ready_s=0.0)
    w = _adaptive_decision(num_prompt_tokens, seen, loads, prefill_side, cfg, cost)
    if (w.estimated_ttft_s + ready_s >= d.estimated_ttft_s
            or w.load_plan.num_cached_blocks <= d.load_plan.num_cached_blocks):
        return d
    waited = tuple(dataclasses.replace(c, wait_s=c.wait_s + ready_s, ttft_s=c.ttft_s + ready_s,
                                       score=c.score + ready_s) for c in w.candidates)
    return dataclasses.replace(w, estimated_ttft_s=w.estimated_ttft_s + ready_s, wait_for_l3_s=ready_s,
                               reason=DecisionReason.WAIT_FOR_L3, candidates=waited)


def _route_adaptive(num_prompt_tokens: int, match: PrefixMatch, loads: Sequence[WorkerLoad],
                    prefill_side: Sequence[WorkerLoad], cfg: RoutingConfig, cost: CostModel) -> RouteDecision:
    d = _adaptive_decision(num_prompt_tokens, match, loads, prefill_side, cfg, cost)
    d = _read_after_write(d, num_prompt_tokens, match, loads, prefill_side, cfg, cost)
    _admit(d.candidates, cfg)
    return d


def prefill_work_tokens(num_new_tokens: int, num_cached_tokens: int, attn_coeff: float) -> float:
    """The work of computing ``num_new_tokens`` on ``num_cached_tokens``, in tokens without
    attention context: ``n · (1 + attn_coeff · (p + n/2))`` (each new token attends to the mean
    causal context ``p + n/2``; ``attn_coeff``: a context token's attention cost relative to a
    token's linear cost, a property of the architecture,
    :attr:`cpd.costmodel.model_shapes.ModelShape.prefill_attn_coeff`)."""
    if num_new_tokens <= 0:
        return 0.0
    return num_new_tokens * (1.0 + attn_coeff * (num_cached_tokens + num_new_tokens / 2))


def prefill_scale_tokens_per_s(num_new_tokens: int, num_cached_tokens: int, seconds: float,
                               attn_coeff: float) -> float:
    """The prefill scale that one measured prefill shows: :func:`prefill_work_tokens` per second.
    With the architecture's ``attn_coeff`` a cold prompt and a warm turn of the same engine give
    the same scale (``LinearCostModel.prefill_tokens_per_s``)."""
    return prefill_work_tokens(num_new_tokens, num_cached_tokens, attn_coeff) / seconds


@dataclass(frozen=True)
class LinearCostModel:
    """A measured cost model for live routing (the simulator's instances run a roofline).

    prefill time = prefill_overhead_s + :func:`prefill_work_tokens` / prefill_tokens_per_s, i.e.
    ``n / rate · (1 + attn_coeff · (cached + new/2))`` + overhead, ``a + b·n + c·n·(p + n/2)`` with
    ``b = 1/rate`` and ``c = attn_coeff/rate`` (the form :mod:`cpd.costmodel.calibrated` fits to
    measured steps); load time = bytes / bandwidth(tier) + overhead(tier). ``attn_coeff`` (the
    *shape*) is the architecture's, advertised by the workers (:mod:`cpd.costmodel.prior`); the
    live router measures the *scale* ``prefill_tokens_per_s`` (tokens without attention context
    per second; plain tokens per second when ``attn_coeff`` is 0) from the prefills workers report
    (or, with ``router.prefill_cost_fit``, fits all three prefill terms), and the bandwidths from
    their measured loads (``cpd.router.estimates``).
    """

    kv_bytes_per_token: int
    prefill_tokens_per_s: float = 2000.0
    attn_coeff: float = 0.0
    l2_bytes_per_s: float = 5e9
    l3_bytes_per_s: float = 1e9
    l2_overhead_s: float = 1e-4
    l3_overhead_s: float = 2e-3
    prefill_overhead_s: float = 0.0

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        if num_new_tokens <= 0:
            return 0.0
        work = prefill_work_tokens(num_new_tokens, num_cached_tokens, self.attn_coeff)
        return self.prefill_overhead_s + work / self.prefill_tokens_per_s

    def load_time_s(self, tier: str, num_bytes: int) -> float:
        if tier == "L2":
            return num_bytes / self.l2_bytes_per_s + self.l2_overhead_s
        return num_bytes / self.l3_bytes_per_s + self.l3_overhead_s
