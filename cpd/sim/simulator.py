"""Discrete-event cluster simulator that runs the real routing policy and engine scheduler.

* Virtual clock; a ``heapq`` of ``(time, seq, callback, args)`` where ``seq`` is a global
  insertion counter, so equal-time events run in insertion order (deterministic). No wall
  clock, threads or asyncio. Randomness only in the (seeded) workload generator.
* Routing: :func:`cpd.policy.routing.route` (the module the live router imports), fed with
  the router's *delayed* view of the KV events (block stored / removed per tier and worker;
  applied ``kv_event_delay_s`` after the change) and the workers' load snapshots.
* Engine steps: every instance step calls :func:`cpd.engine.scheduler.schedule` and is one
  event whose duration comes from the cost model (prefill chunks and decodes together).
  Decode-only steps of an unchanged batch are fast-forwarded: when the waiting queue is
  empty and the plan is "every running sequence decodes one token", the next ``k`` plans
  are identical until a sequence finishes, a handoff arrives or a block must be allocated
  beyond the free ones, so the simulator applies ``k`` steps in one event (``k`` chosen
  so none of those happens; an arriving handoff cuts the macro-step at the end of the step
  in progress). ``exact_decode=True`` disables this (one event per decode step); a test
  checks both agree.
* Blocks: ``block_size``-token blocks identified by the trace's prefix-hash ids (used
  directly, no tokenisation). L1 = device pool: an LRU of cached blocks plus the blocks
  newly allocated by running sequences (``used``); an L1 prefix hit is shared, counted
  once, in the LRU (as vLLM shares cached blocks). The scheduler sees
  ``num_free_blocks = capacity - used`` (cached blocks are evictable), L2 = host DRAM (inclusive: every block stored
  in L1 is also written to L2), L3 = shared store (capacity-limited LRU; blocks become
  visible when the write flow completes). Write-through to L3 is per role.
* Links: each prefill-side instance has a PCIe link (L2 loads) and a NIC (L3 loads and
  writes, KV handoff to decode); concurrent flows share a link's bandwidth equally.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cpd.engine import scheduler as _scheduler
from cpd.engine.scheduler import SchedulerConfig, SeqState, blocks_for
from cpd.policy import routing as _routing
from cpd.policy.routing import (ROLE_DECODE, PrefixMatch, RoutingConfig,
                                WorkerLoad)
from cpd.policy.cost_model import RooflineCostModel
from cpd.sim.cache import BlockLRU, leading_in
from cpd.sim.links import Link
from cpd.sim.workload import SimRequest
from cpd.types import Role

# The very functions the live system uses (tests assert identity).
route = _routing.route
schedule = _scheduler.schedule


@dataclass(frozen=True)
class InstanceSpec:
    """One engine instance (a TP group or one DP rank).

    Attributes:
        role: ``pre-prefill`` | ``prefill`` | ``decode``.
        cost: its cost model (tp = GPUs of the instance).
        sched: scheduler limits (``block_size`` must equal the cluster's block size).
        l1_blocks: device KV pool, blocks (None = from the cost model's HBM capacity).
        l2_blocks: host-DRAM tier, blocks (0 = none).
        write_l3: write computed full blocks through to L3.
    """

    role: str
    cost: RooflineCostModel
    sched: SchedulerConfig
    l1_blocks: int | None = None
    l2_blocks: int = 0
    write_l3: bool = False


@dataclass(frozen=True)
class ClusterSpec:
    """A deployment: instances, shared L3, routing config, event delay."""

    instances: tuple[InstanceSpec, ...]
    routing: RoutingConfig
    router_cost: RooflineCostModel
    block_size: int = 512
    l3_blocks: int = 0
    kv_event_delay_s: float = 0.05
    exact_decode: bool = False

    @property
    def num_gpus(self) -> int:
        return sum(i.cost.tp for i in self.instances)


class _Seq:
    __slots__ = ("i", "req", "num_tokens", "computed", "alloc", "shared", "remaining", "enq_t", "adm_t", "inst")

    def __init__(self, i: int, req: SimRequest, num_tokens: int, computed: int, inst: _Inst):
        self.i, self.req, self.num_tokens, self.computed = i, req, num_tokens, computed
        self.alloc = 0
        self.shared = 0  # leading blocks that are L1 prefix-cache hits (counted in the LRU, not in used)
        self.remaining = 0
        self.enq_t = self.adm_t = -1.0
        self.inst = inst  # the instance it is queued / running on


class _Inst:
    def __init__(self, sim: "Simulator", wid: str, spec: InstanceSpec):
        self.wid, self.spec, self.role, self.cost, self.cfg = wid, spec, Role(spec.role), spec.cost, spec.sched
        bs = sim.bs
        self.cap = spec.l1_blocks if spec.l1_blocks is not None else spec.cost.kv_capacity_tokens // bs
        self.l1 = BlockLRU(self.cap)
        self.l2 = BlockLRU(spec.l2_blocks) if spec.l2_blocks else None
        self.used = 0
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.loading = 0
        self.pending_tokens = 0
        self.busy = False
        self.version = 0
        self.macro: tuple[float, float, int, int] | None = None  # (t0, dt, k, version) of an in-flight decode macro-step
        self.pcie = Link(sim, f"{wid}.pcie", spec.cost.link_bytes_per_s("L2"), spec.cost.link_latency_s("L2"))
        self.nic = Link(sim, f"{wid}.nic", spec.cost.link_bytes_per_s("NIC"), spec.cost.link_latency_s("L3"))
        self.busy_s = 0.0
        self.tokens = 0  # prefill tokens computed or decode tokens generated
        self.steps = 0



class Simulator:
    """Run one workload on one cluster; results via :meth:`records` and counters.

    Args:
        cluster: the deployment.
        requests: arrivals (any order; sorted by time then index).
        stop_s: stop processing events at this virtual time (None: run to completion).
        on_progress: optional ``callable(virtual_now)`` called every ~2000 events.
        prewarm: block-id lists placed in L3 (and the router's view) at t=0.
    """

    def __init__(self, cluster: ClusterSpec, requests: Sequence[SimRequest], stop_s: float | None = None,
                 on_progress: Callable[[float], None] | None = None, prewarm: Sequence[Sequence[int]] = ()):
        self.c = cluster
        self.bs = cluster.block_size
        self.now = 0.0
        self._q: list = []
        self._n = 0
        self.stop_s = stop_s
        self.on_progress = on_progress
        self.insts = [_Inst(self, f"{s.role}-{k}", s) for k, s in enumerate(cluster.instances)]
        self.by_id = {w.wid: w for w in self.insts}
        self.l3 = BlockLRU(cluster.l3_blocks) if cluster.l3_blocks else None
        self.l3_writing: set[int] = set()
        self.kvpt = cluster.router_cost.kv_bytes_per_token
        self.block_bytes = self.bs * self.kvpt
        # router's delayed view
        self.v_l1: dict[str, set[int]] = {w.wid: set() for w in self.insts}
        self.v_l2: dict[str, set[int]] = {w.wid: set() for w in self.insts}
        self.v_l3: set[int] = set()
        if any(r.deps() for r in requests):
            self.reqs = list(requests)  # closed loop: indices must stay as generated
            if any(d >= i for i, r in enumerate(self.reqs) for d in r.deps()):
                raise ValueError("closed-loop requests must come after the requests they wait for")
        else:
            self.reqs = sorted(requests, key=lambda r: r.arrival_s)
        self._parked: dict[int, list[int]] = {}
        self.deferred = 0
        # per request record: [arrival, cls, pool, worker, l1, l2, l3, ttft_t, done_t, queue_s,
        #                      dq_s, reuse, stale]
        self.rec: list[list[Any] | None] = [None] * len(self.reqs)
        self.events_run = 0
        self.nroute = 0
        # sessions that exist before t=0: their history is in L3, or (no L3) in the L1 and L2
        # of the prefill-side instances, round-robin (as if computed there)
        pside = [w for w in self.insts if w.role != ROLE_DECODE]
        for k, blocks in enumerate(prewarm):
            blocks = tuple(blocks)
            if self.l3 is not None:
                new, ev = self.l3.touch_insert(blocks)
                self.v_l3.update(new)
                self.v_l3.difference_update(ev)
            elif pside:
                w = pside[k % len(pside)]
                for lru, view in ((w.l1, self.v_l1[w.wid]), (w.l2, self.v_l2[w.wid])):
                    if lru is not None:
                        new, ev = lru.touch_insert(blocks)
                        view.update(new)
                        view.difference_update(ev)
        for i, r in enumerate(self.reqs):
            self.at(r.arrival_s, self._arrive, i)

    # -- event queue ---------------------------------------------------------------
    def at(self, t: float, fn, *args) -> None:
        self._n += 1
        heapq.heappush(self._q, (t, self._n, fn, args))

    def run(self) -> "Simulator":
        q = self._q
        pop = heapq.heappop
        stop = self.stop_s
        n = 0
        while q:
            t, _, fn, args = pop(q)
            if stop is not None and t > stop:
                self.now = stop
                break
            self.now = t
            fn(t, *args)
            n += 1
            if self.on_progress is not None and n % 2000 == 0:
                self.on_progress(t)
        self.events_run = n
        return self

    # -- KV events -----------------------------------------------------------------
    def _publish(self, now: float, view: set, stored: Sequence[int], removed: Sequence[int]) -> None:
        if not stored and not removed:
            return
        d = self.c.kv_event_delay_s
        if d <= 0:
            self._apply(now, view, tuple(stored), tuple(removed))
        else:
            self.at(now + d, self._apply, view, tuple(stored), tuple(removed))

    @staticmethod
    def _apply(now: float, view: set, stored, removed) -> None:
        view.update(stored)
        view.difference_update(removed)

    def _record(self, i: int) -> list[Any]:
        """The record of request ``i``, which has been routed (it has one)."""
        rec = self.rec[i]
        if rec is None:
            raise RuntimeError(f"request {i} has no record: it was never routed")
        return rec

    # -- router --------------------------------------------------------------------
    def _loads(self) -> list[WorkerLoad]:
        out = []
        for w in self.insts:
            out.append(WorkerLoad(w.wid, w.role, w.pending_tokens,
                                  len(w.running) + len(w.waiting) + w.loading,
                                  (w.used / w.cap) if w.cap else 1.0))
        return out

    def _arrive(self, now: float, i: int, released: bool = False) -> None:
        r = self.reqs[i]
        if not released and self._park(i):
            self.deferred += 1
            return
        blocks = r.blocks
        cap = max(0, (r.prompt_tokens - 1) // self.bs)
        l1, l2 = {}, {}
        for w in self.insts:
            if w.role == ROLE_DECODE:
                continue
            a = leading_in(self.v_l1[w.wid], blocks, cap)
            if a:
                l1[w.wid] = a
            b = leading_in(self.v_l2[w.wid], blocks, cap)
            if b:
                l2[w.wid] = b
        match = PrefixMatch(l1, l2, leading_in(self.v_l3, blocks, cap))
        d = route(r.prompt_tokens, match, self._loads(), self.c.routing, self.c.router_cost)
        self.nroute += 1
        w = self.by_id[d.prefill_worker]
        plan = d.load_plan
        # what the worker really holds (the index may be stale): recompute what is gone
        a = min(plan.l1_blocks, w.l1.leading(blocks, cap))
        stale = plan.l1_blocks - a
        b2 = a
        if plan.l2_blocks and a == plan.l1_blocks and w.l2 is not None:
            b2 = max(a, min(a + plan.l2_blocks, w.l2.leading(blocks, cap)))
            stale += a + plan.l2_blocks - b2
        c3 = b2
        if plan.l3_blocks and b2 == plan.l1_blocks + plan.l2_blocks and self.l3 is not None:
            c3 = max(b2, min(b2 + plan.l3_blocks, self.l3.leading(blocks, cap)))
            stale += b2 + plan.l3_blocks - c3
        if a:
            w.l1.touch_insert(blocks[:a])
        if w.l2 is not None and b2 > 0:
            w.l2.touch_insert(blocks[:min(b2, w.l2.leading(blocks, cap))])
        if self.l3 is not None and c3 > b2:
            self.l3.touch_insert(blocks[:c3])
        cached = c3 * self.bs
        self.rec[i] = [now, d.request_class, d.pool, w.wid, a * self.bs, (b2 - a) * self.bs,
                       (c3 - b2) * self.bs, None, None, None, None, d.reuse_ratio, stale, d.decode_worker, now]
        s = _Seq(i, r, r.prompt_tokens, cached, w)
        s.alloc = s.shared = a
        w.loading += 1
        w.pending_tokens += r.prompt_tokens - cached
        flows = int(b2 > a) + int(c3 > b2)
        if flows == 0:
            self._loaded(now, s, 0)
            return
        box = [flows]
        if b2 > a:
            w.pcie.start(now, (b2 - a) * self.block_bytes, self._load_part, s, box)
        if c3 > b2:
            w.nic.start(now, (c3 - b2) * self.block_bytes, self._load_part, s, box)

    def _load_part(self, now: float, s: _Seq, box: list) -> None:
        box[0] -= 1
        if box[0] == 0:
            self._loaded(now, s, 0)

    def _loaded(self, now: float, s: _Seq, _unused: int) -> None:
        w = s.inst
        w.loading -= 1
        s.enq_t = now
        w.waiting.append(s)
        self._kick(now, w)

    # -- engine steps ----------------------------------------------------------------
    def _kick(self, now: float, w: _Inst) -> None:
        if w.busy:
            if w.macro is not None and w.waiting:
                self._cut_macro(now, w)
            return
        if w.waiting or w.running:
            self._step(now, w)

    def _step(self, now: float, w: _Inst) -> None:
        run = w.running
        st = [SeqState(s.i, s.num_tokens, s.computed, s.alloc) for s in run]
        # only the head of the queue can be admitted (FCFS, at most max_num_seqs running):
        # passing it alone gives the same plan as passing the whole queue
        head = w.cfg.max_num_seqs - len(run)
        wt = [SeqState(s.i, s.num_tokens, s.computed, s.alloc)
              for s in (w.waiting if len(w.waiting) <= head else list(w.waiting)[:max(0, head)])]
        plan = schedule(st, wt, w.cap - w.used, w.cfg)
        if plan.preempted:
            pre = set(plan.preempted)
            back = []
            for s in run:
                if s.i in pre:
                    w.used -= s.alloc - s.shared
                    s.alloc = s.shared = 0
                    if w.role != ROLE_DECODE:
                        w.pending_tokens += s.computed
                        s.computed = 0
                    back.append(s)
            run[:] = [s for s in run if s.i not in pre]
        else:
            back = []
        byid = {s.i: s for s in run}
        for _ in plan.admitted:
            s = w.waiting.popleft()
            s.adm_t = now
            if w.role == ROLE_DECODE:
                self._record(s.i)[10] = now - s.enq_t
            run.append(s)
            byid[s.i] = s
        for s in reversed(back):
            w.waiting.appendleft(s)
        if not plan.scheduled:
            w.busy = False
            return
        items = []
        for x in plan.scheduled:
            s = byid[x.request_id]
            s.alloc += x.num_new_blocks
            w.used += x.num_new_blocks
            items.append((s, x.num_new_tokens))
        if w.l1.capacity is not None and w.role != ROLE_DECODE:
            self._evict_l1(now, w)
        w.busy = True
        w.version += 1
        if w.role == ROLE_DECODE:
            nseq = len(items)
            ctx = sum(s.computed for s, _ in items)
            k = 1
            if (not self.c.exact_decode and not w.waiting and not plan.admitted and not plan.preempted
                    and nseq == len(run)):
                k = min(s.remaining for s, _ in items)
                free = w.cap - w.used
                if k > 1:
                    need = sum(max(0, blocks_for(s.computed + k, self.bs) - s.alloc) for s, _ in items)
                    if need > free:
                        k = 1
            dt = w.cost.decode_step_time_s(nseq, ctx + (k - 1) * nseq // 2 + nseq)
            w.macro = (now, dt, k, w.version) if k > 1 else None
            w.busy_s += k * dt
            self.at(now + k * dt, self._end_decode, w, items, k, w.version)
        else:
            dt = w.cost.step_time_s(tuple((n, s.computed) for s, n in items))
            self.at(now + dt, self._end_prefill, w, items, dt)

    def _cut_macro(self, now: float, w: _Inst) -> None:
        if w.macro is None:
            raise RuntimeError(f"{w.wid}: no decode macro-step in flight to cut")
        t0, dt, k, ver = w.macro
        j = int((now - t0) / dt) + 1  # steps done once the step in progress ends
        if j >= k:
            return
        w.version += 1
        w.macro = None
        w.busy_s -= (k - j) * dt
        # re-issue the end event with the shortened step count (items are re-read at end)
        self.at(t0 + j * dt, self._end_decode_cut, w, j, dt)

    def _end_decode_cut(self, now: float, w: _Inst, j: int, dt: float) -> None:
        items = [(s, 1) for s in w.running]
        self._finish_decode(now, w, items, j, dt * j)

    def _end_decode(self, now: float, w: _Inst, items, k: int, version: int) -> None:
        if version != w.version:
            return
        self._finish_decode(now, w, items, k, None)

    def _finish_decode(self, now: float, w: _Inst, items, k: int, busy: float | None) -> None:
        w.macro = None
        w.busy = False
        w.steps += k
        done = []
        for s, _ in items:
            s.computed += k
            s.remaining -= k
            w.tokens += k
            nb = blocks_for(s.computed, self.bs)
            if nb > s.alloc:
                w.used += nb - s.alloc
                s.alloc = nb
            if s.remaining <= 0:
                done.append(s)
            else:
                s.num_tokens = s.computed + 1
        if done:
            ds = set(id(s) for s in done)
            w.running = [s for s in w.running if id(s) not in ds]
            for s in done:
                w.used -= s.alloc
                s.alloc = 0
                self._record(s.i)[8] = now
                self._release(now, s.i)
        self._kick(now, w)

    def _end_prefill(self, now: float, w: _Inst, items, dt: float) -> None:
        w.busy = False
        w.busy_s += dt
        w.steps += 1
        finished = []
        for s, n in items:
            s.computed += n
            w.tokens += n
            w.pending_tokens -= n
            if s.computed >= s.num_tokens:
                finished.append(s)
        if finished:
            fs = set(id(s) for s in finished)
            w.running = [s for s in w.running if id(s) not in fs]
            for s in finished:
                self._prefill_done(now, w, s)
        self._kick(now, w)

    def _prefill_done(self, now: float, w: _Inst, s: _Seq) -> None:
        rec = self._record(s.i)
        rec[9] = s.adm_t - s.enq_t
        full = s.req.blocks[: s.req.prompt_tokens // self.bs]
        if w.spec.write_l3 and self.l3 is not None and full:
            todo = [b for b in full if b not in self.l3 and b not in self.l3_writing]
            if todo:
                self.l3_writing.update(todo)
                w.nic.start(now, len(todo) * self.block_bytes, self._l3_written, full, todo)
        dec = rec[13]
        w.nic.start(now, s.req.prompt_tokens * self.kvpt, self._handoff_done, w, s, dec)

    def _l3_written(self, now: float, full, todo) -> None:
        self.l3_writing.difference_update(todo)
        if self.l3 is None:
            raise RuntimeError("an L3 write finished in a cluster without L3")
        new, ev = self.l3.touch_insert(full)
        self._publish(now, self.v_l3, new, ev)

    def _evict_l1(self, now: float, w: _Inst) -> None:
        ev = w.l1.shrink(w.cap - w.used)
        if ev:
            self._publish(now, self.v_l1[w.wid], (), ev)

    def _handoff_done(self, now: float, w: _Inst, s: _Seq, dec: str | None) -> None:
        # prefill side: release the pinned blocks, cache the full blocks (L1, and L2 inclusive)
        w.used -= s.alloc - s.shared
        s.alloc = s.shared = 0
        full = s.req.blocks[: s.req.prompt_tokens // self.bs]
        if full:
            new, ev = w.l1.touch_insert(full, w.cap - w.used)
            self._publish(now, self.v_l1[w.wid], new, ev)
            if w.l2 is not None:
                new2, ev2 = w.l2.touch_insert(full)
                self._publish(now, self.v_l2[w.wid], new2, ev2)
        rec = self._record(s.i)
        rec[7] = now  # first token leaves with the handoff
        self._kick(now, w)
        if dec is None or s.req.output_tokens <= 1:
            rec[8] = now
            self._release(now, s.i)
            return
        d = self.by_id[dec]
        ds = _Seq(s.i, s.req, s.req.prompt_tokens + 1, s.req.prompt_tokens, d)
        ds.remaining = s.req.output_tokens - 1
        ds.enq_t = now
        d.waiting.append(ds)
        self._kick(now, d)

    def _park(self, i: int) -> bool:
        """Park request ``i`` on the first request it waits for that has not finished (False: none)."""
        for d in self.reqs[i].deps():
            prev = self.rec[d]
            if prev is None or prev[8] is None:
                self._parked.setdefault(d, []).append(i)
                return True
        return False

    def _release(self, now: float, i: int) -> None:
        for j in self._parked.pop(i, ()):
            if self._park(j):  # still waiting for another request (e.g. a second subagent)
                continue
            r = self.reqs[j]
            self.at(max(now + r.think_s, r.arrival_s), self._arrive, j, True)

    # -- results -------------------------------------------------------------------------
    def links(self) -> list[Link]:
        return [l for w in self.insts for l in (w.pcie, w.nic)]
