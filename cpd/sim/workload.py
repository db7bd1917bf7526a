"""Workloads for the simulator: Mooncake-format trace replay and a synthetic coding-agent generator.

Both produce :class:`SimRequest` lists; the generator also writes Mooncake JSONL
(``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``, one request per
line, 512-token prefix-hash blocks) so that ``cpd bench`` can replay it live.

Block ids: the trace's ``hash_ids`` are already *prefix* hashes (an equal id at position k
means the whole prefix up to block k is equal), so the simulator uses them directly as
block identities; it does not tokenise and does not call ``cpd.kv.block_hash``.
"""
from __future__ import annotations

import json
import math
import random
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

TRACE_BLOCK = 512


@dataclass(frozen=True)
class SimRequest:
    """One request.

    Attributes:
        arrival_s: arrival time at the router, seconds.
        prompt_tokens: prompt length, tokens.
        output_tokens: tokens to generate (>= 1).
        blocks: prefix-hash block ids, one per ``block_size`` tokens (the last may be partial).
        tag: workload label (``cold``/``warm`` for the synthetic generator, ``trace`` otherwise).
        after: closed loop: index (in the request list) of the session's previous turn, or a
            tuple of indices (a trace's request waits for every one of them: its predecessor and
            the subagents it started); the simulator delays this request until they have
            finished, plus ``think_s`` (-1 = open loop: arrive at ``arrival_s``). Not written to
            Mooncake JSONL.
        think_s: seconds between the previous turn's last token and this arrival (closed loop).
    """

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    tag: str = "trace"
    after: int | tuple[int, ...] = -1
    think_s: float = 0.0

    def deps(self) -> tuple[int, ...]:
        """Indices of the requests this one waits for (closed loop; ``()`` for open loop)."""
        a = self.after
        if isinstance(a, tuple):
            return a
        return (a,) if a >= 0 else ()


def load_mooncake(path: str | Path, time_scale: float = 1.0, tokens_per_hash_id: int = TRACE_BLOCK,
                  limit: int | None = None, spread_ticks_s: float = 0.0, max_prompt_tokens: int | None = None,
                  ) -> list[SimRequest]:
    """A Mooncake JSONL trace through :mod:`cpd.traces` (the same conversion and arrival model as
    ``cpd bench``): ``spread_ticks_s > 0`` spreads each tick over that many seconds (capped by the
    gap to the next tick), ``time_scale`` 2 = twice the load; block ids are the trace's hash ids."""
    from cpd.traces import ReplayOptions, read_mooncake

    opts = ReplayOptions(tokens_per_block=tokens_per_hash_id, time_scale=time_scale, max_requests=limit,
                         spread_ticks=spread_ticks_s > 0, tick_ms=spread_ticks_s * 1000.0,
                         max_prompt_tokens=max_prompt_tokens)
    return trace_workload(read_mooncake(path), opts, sim_block_tokens=tokens_per_hash_id)


def trace_workload(trace, opts, sim_block_tokens: int = TRACE_BLOCK) -> list[SimRequest]:
    """Any trace as simulator requests: :func:`cpd.traces.build_schedule` (the live replay's
    schedule, request for request) with blocks regrouped to ``sim_block_tokens`` replayed tokens
    (:func:`cpd.traces.sim_blocks`); ``tag`` = the request kind; closed-loop dependencies kept."""
    from cpd.traces import Vocab, build_schedule

    sched = build_schedule(trace, opts, Vocab(2))  # token ids are never drawn here
    return schedule_to_sim(sched, opts.tokens_per_block or trace.block_tokens, sim_block_tokens)


def schedule_to_sim(sched, tokens_per_block: int, sim_block_tokens: int) -> list[SimRequest]:
    """Replay requests → :class:`SimRequest` (arrival, prompt and output tokens, blocks, kind, after, gap)."""
    from cpd.traces import sim_blocks

    return [SimRequest(q.arrival_s, q.prompt_len, max(1, q.max_tokens),
                       sim_blocks(q, tokens_per_block, sim_block_tokens), q.kind,
                       q.after if q.after else -1, q.gap_s) for q in sched]


def write_mooncake(reqs: Iterable[SimRequest], path: str | Path) -> None:
    """Write requests as Mooncake JSONL (timestamps in integer milliseconds)."""
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": int(round(r.arrival_s * 1000)), "input_length": r.prompt_tokens,
                                "output_length": r.output_tokens, "hash_ids": list(r.blocks)}) + "\n")


@dataclass(frozen=True)
class AgentWorkload:
    """Synthetic coding-agent traffic (all lengths in tokens, times in seconds).

    A request is *cold* with probability ``cold_fraction`` (a new session: a shared system
    prompt plus ``first_context`` new tokens) and otherwise a *warm* turn of an existing
    session: its previous prompt + previous output + a new ``turn_suffix``. A session whose
    prompt would exceed ``max_context`` is compacted: its next request is cold, with a fresh
    ``compacted_context``-token summary (extra cold requests). With ``prewarm`` the run
    starts in steady state: ``qps * mean_turn_gap_s`` sessions already exist at t=0 (their
    history is returned separately so the simulator can place it in L3; it is not written
    as requests), and the pool keeps that size (a new session retires the longest-idle
    one), so a session's turns come about ``mean_turn_gap_s`` apart. With ``closed_loop`` a
    turn also waits for the previous turn's answer plus ``think_s`` (as an agent does), so
    an overloaded cluster slows its own offered load instead of receiving turns whose
    prefix is not cached yet. A warm turn goes to the
    longest-idle session if its last request is at least ``min_turn_gap_s`` old; otherwise a
    new session starts instead (so the realised cold fraction can exceed the knob).
    """

    cold_fraction: float = 0.1
    first_context: int = 100_000
    first_context_jitter: float = 0.3
    turn_suffix: int = 2_000
    output_tokens: int = 300
    output_jitter: float = 0.5
    system_prompt: int = 4_096
    max_context: int = 131_072
    compacted_context: int = 40_000
    min_turn_gap_s: float = 10.0
    max_active_sessions: int = 400
    mean_turn_gap_s: float = 30.0
    prewarm: bool = True
    closed_loop: bool = True
    think_s: float = 2.0
    block_size: int = TRACE_BLOCK


def _rate_at(t: float, qps: float, ramp_s: float) -> float:
    return qps * (t / ramp_s if (ramp_s > 0 and t < ramp_s) else 1.0)


def generate_agent(w: AgentWorkload, qps: float, duration_s: float, ramp_s: float = 0.0,
                   seed: int = 0) -> list[SimRequest]:
    """Requests only (see :func:`agent_workload`)."""
    return agent_workload(w, qps, duration_s, ramp_s, seed)[0]


def agent_workload(w: AgentWorkload, qps: float, duration_s: float, ramp_s: float = 0.0,
                   seed: int = 0) -> tuple[list[SimRequest], list[tuple[int, ...]]]:
    """Seeded Poisson arrivals at ``qps`` (linear ramp from 0 over ``ramp_s``) for ``duration_s`` s.

    Returns:
        (requests in arrival order, with ``tag`` = ``cold``/``warm`` (the generator's intent);
        full-block id lists of the sessions that exist at t=0 (empty unless ``w.prewarm``)).
    Raises:
        ValueError: non-positive qps.
    """
    if qps <= 0:
        raise ValueError("qps must be > 0")
    rng = random.Random(seed)
    bs = w.block_size
    next_id = 1
    sys_blocks = w.system_prompt // bs
    sys_ids = list(range(next_id, next_id + sys_blocks))
    next_id += sys_blocks
    # session: [full block ids of last prompt, last prompt tokens, last output, last time, last index]
    active: deque[list] = deque()
    out: list[SimRequest] = []
    prewarm: list[tuple[int, ...]] = []
    cap = w.max_active_sessions
    if w.prewarm:
        cap = max(1, int(round(qps * w.mean_turn_gap_s)))
        for k in range(cap):
            ctx = int(w.first_context * (1 + w.first_context_jitter * (2 * rng.random() - 1)))
            ctx += int(rng.random() * (w.max_context - w.system_prompt - ctx - w.turn_suffix) * 0.5)
            prompt = w.system_prompt + max(0, ctx)
            nb = prompt // bs
            ids = sys_ids + list(range(next_id, next_id + nb - sys_blocks))
            next_id += nb - sys_blocks
            prewarm.append(tuple(ids))
            # last use spread over the past gap, oldest first
            active.append([ids, prompt, w.output_tokens, -w.mean_turn_gap_s * (1 - k / cap), -1])
    t = 0.0
    # thinning for the ramp: homogeneous rate qps, accept with rate(t)/qps
    while True:
        t += rng.expovariate(qps)
        if t >= duration_s:
            break
        if rng.random() * qps > _rate_at(t, qps, ramp_s):
            continue
        outl = max(1, int(w.output_tokens * (1 + w.output_jitter * (2 * rng.random() - 1))))
        sess = None
        if rng.random() >= w.cold_fraction and active:
            # the longest-idle session takes the turn if it has been idle long enough
            if t - active[0][3] >= w.min_turn_gap_s:
                sess = active.popleft()
                active.append(sess)
        if sess is not None:
            prompt = sess[1] + sess[2] + w.turn_suffix
            if prompt > w.max_context:  # compaction: a new cold context for this session
                prompt = w.system_prompt + w.compacted_context
                full = prompt // bs
                ids = sys_ids + list(range(next_id, next_id + full - sys_blocks + 1))
                tag = "cold"
            else:
                keep = sess[0]
                nb = -(-prompt // bs)
                ids = keep + list(range(next_id, next_id + nb - len(keep)))
                tag = "warm"
        else:
            ctx = int(w.first_context * (1 + w.first_context_jitter * (2 * rng.random() - 1)))
            prompt = min(w.max_context - w.output_tokens, w.system_prompt + ctx)
            nb = -(-prompt // bs)
            ids = sys_ids + list(range(next_id, next_id + nb - sys_blocks))
            tag = "cold"
            sess = [None, 0, 0, t, -1]
            active.append(sess)
            if len(active) > cap:
                active.popleft()
        next_id = max(next_id, max(ids) + 1)
        after = sess[4] if (w.closed_loop and tag == "warm") else -1
        sess[0] = ids[: prompt // bs]
        sess[1], sess[2], sess[3], sess[4] = prompt, outl, t, len(out)
        out.append(SimRequest(round(t, 6), prompt, outl, tuple(ids), tag, after, w.think_s if after >= 0 else 0.0))
    return out, prewarm
