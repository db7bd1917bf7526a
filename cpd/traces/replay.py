"""A trace as a replay schedule: the requests ``cpd bench`` sends and ``cpd simulate`` simulates.

``build_schedule(trace, opts, vocab)`` is the only place where trace requests become replayed
requests: block keys and token blocks (:mod:`cpd.traces.blocks`), truncation, the shared prefix,
arrivals and closed-loop dependencies (:mod:`cpd.traces.arrivals`), and the request *kind*.

Request kinds (``ReplayRequest.kind``), from an infinite prefix cache over the schedule in order,
in the trace's own tokens (before any shrink):

* ``cold``: reuse ratio (cached prefix tokens / prompt tokens) below ``cold_threshold`` (0.5):
  session starts and new contexts;
* ``warm_small``: warm with at most ``large_suffix_tokens`` (8192) uncached tokens;
* ``warm_large``: warm with more uncached tokens than that (a large tool result appended to a
  long history: high reuse ratio, yet heavy prefill work);
* ``subagent``: any request of a Claude Code subagent.

``trace_class`` keeps the two-way ``cold`` / ``warm`` split by reuse ratio.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .arrivals import DEFAULT_TICK_MS, arrival_times, poisson_starts, think_gap_s
from .blocks import BlockTokens, Vocab, block_key, shrink, truncate_blocks
from .model import Subagent, Trace, TraceRequest, TraceSession

KINDS = ("cold", "warm_small", "warm_large", "subagent")


@dataclass
class ReplayOptions:
    """Every knob of a replay; recorded with results (``asdict``).

    Token counts named ``*_trace_tokens`` / ``max_context`` are in the trace's tokens; the others
    in replayed tokens. ``tokens_per_block`` None keeps the trace's block size (no shrink).
    """

    tokens_per_block: int | None = None
    seed: int = 0
    time_scale: float = 1.0
    spread_ticks: bool = False
    tick_ms: float = DEFAULT_TICK_MS
    users: int | None = None
    session_rate: float | None = None
    shared_prefix_fraction: float = 0.0
    azure_prefix_tokens: int = 0
    max_context: int | None = None
    max_prompt_tokens: int | None = None
    context_len: int | None = None
    max_output_tokens: int | None = None
    cold_threshold: float = 0.5
    large_suffix_tokens: int = 8192
    collapse_pairs: bool = False
    start: int = 0
    max_requests: int | None = None  # timed traces: requests in all; sessions: per session
    max_sessions: int | None = None
    max_idle_s: float | None = None

    def arrival_model(self, trace: Trace) -> str:
        """One line naming the arrival model in force."""
        if trace.timed:
            return (f"trace timestamps / time_scale {self.time_scale:g}, "
                    + ("ticks spread" if self.spread_ticks else "ticks kept"))
        if self.users is not None:
            return f"closed loop: {self.users} users, think_time between requests (time_scale {self.time_scale:g})"
        return f"open loop: Poisson session starts at {self.session_rate:g}/s, in-session t kept"

    def check(self, trace: Trace) -> None:
        """Raise ``ValueError`` for options that do not fit this trace."""
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError("shared_prefix_fraction must be in [0, 1]")
        tpb = self.tokens_per_block
        if tpb is not None and not 1 <= tpb <= trace.block_tokens:
            raise ValueError(f"tokens_per_block must be in [1, {trace.block_tokens}] for this trace "
                             f"({trace.block_tokens}-token blocks), got {tpb}")
        if trace.timed and (self.users is not None or self.session_rate is not None):
            raise ValueError(f"a {trace.format} trace has no sessions: its arrivals are its timestamps "
                             "(scale load with time_scale); users / session_rate apply to Claude Code traces")
        if not trace.timed and (self.users is None) == (self.session_rate is None):
            raise ValueError("a Claude Code trace needs exactly one arrival model: users N (closed loop) "
                             "or session_rate R (open loop, sessions/s)")
        if self.max_idle_s is not None and self.max_idle_s < 0:
            raise ValueError("max_idle_s must be >= 0")
        if self.users is not None and self.users < 1:
            raise ValueError("users must be >= 1")
        for name in ("max_context", "max_prompt_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.context_len is not None and self.context_len < 2:
            raise ValueError("context_len must be >= 2")


@dataclass
class ReplayRequest:
    """A request ready to replay (live) or simulate.

    * ``arrival_s``: send time from the replay's start (open loop); for a request with ``after``
      it is only a lower bound (0): it is sent ``gap_s`` after all requests in ``after``
      (indices into the schedule) have finished;
    * ``hash_ids``: block keys (:func:`block_key`), one per replayed block; ``block_lens`` their
      replayed token counts (``prompt`` is built on demand from ``blocks``);
    * ``input_length`` / ``cached_trace_tokens`` / ``uncached_trace_tokens``: the trace's prompt
      tokens after ``max_context`` and their infinite-cache split; ``reuse`` their ratio;
    * ``kind`` (4-way) and ``trace_class`` (``cold`` / ``warm``): see the module docstring.
    """

    id: str
    line: int
    arrival_s: float
    max_tokens: int
    hash_ids: list[int]
    block_lens: list[int]
    input_length: int
    reuse: float
    trace_class: str
    blocks: BlockTokens = field(repr=False, compare=False)
    truncated: bool = False
    kind: str = "cold"
    session: str = ""
    after: tuple[int, ...] = ()
    gap_s: float = 0.0
    cached_trace_tokens: int = 0
    uncached_trace_tokens: int = 0
    source: str = ""

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens (``sum(block_lens)``)."""
        return sum(self.block_lens)

    @property
    def prompt(self) -> list[int]:
        """Prompt token ids, built on demand (not stored, so a full-trace replay stays small)."""
        out: list[int] = []
        for h, n in zip(self.hash_ids, self.block_lens):
            out.extend(self.blocks(h, n))
        return out


@dataclass
class _Item:
    """A trace request placed in the schedule, before conversion."""

    req: TraceRequest
    sess: TraceSession
    index: int
    arrival_s: float = 0.0
    after: list["_Item"] = field(default_factory=list)
    gap_s: float = 0.0
    rid: str = ""


class _ScopeKeys(dict):
    """``block_key(scope, h)`` memoised per scope (``__missing__`` keeps lookups in C)."""

    def __init__(self, scope: str) -> None:
        super().__init__()
        self.scope = scope

    def __missing__(self, h: int) -> int:
        k = self[h] = block_key(self.scope, h)
        return k


class _Keys:
    """Memoised :func:`block_key` (a conversation repeats its prefix in every request)."""

    def __init__(self) -> None:
        self._scopes: dict[str, _ScopeKeys] = {}

    def many(self, scope: str | None, ids) -> list[int]:
        if scope is None:
            return list(ids)
        m = self._scopes.get(scope)
        if m is None:
            m = self._scopes[scope] = _ScopeKeys(scope)
        return list(map(m.__getitem__, ids))


def trace_blocks(req: TraceRequest, sess: TraceSession, block_tokens: int, opts: ReplayOptions,
                 keys_of: _Keys | None = None) -> tuple[list[int], list[int]]:
    """``(block keys, trace tokens per block)`` of ``req``: shared prefix, Azure model, tail."""
    B = block_tokens
    keys_of = keys_of or _Keys()
    if req.hash_ids is None:  # Azure: no prefix information; an explicit shared prefix if asked
        n = -(-req.input_tokens // B)
        k = min(n, opts.azure_prefix_tokens // B)
        keys = keys_of.many("shared/azure", range(k)) + keys_of.many(f"azure/{req.source}", range(k, n))
        return keys, [B] * (n - 1) + [req.input_tokens - B * (n - 1)]
    ids = req.hash_ids
    k = min(len(ids), int(opts.shared_prefix_fraction * (sess.tool_tokens + sess.system_tokens)) // B)
    keys = (keys_of.many(f"shared/{sess.role}", range(k)) if k else []) + keys_of.many(sess.scope, ids[k:])
    if sess.scope is None and B * len(ids) >= req.input_tokens:
        # Mooncake: the last id names the partial last block
        return keys, [B] * (len(ids) - 1) + [req.input_tokens - B * (len(ids) - 1)]
    lens = [B] * len(ids)
    tail = req.input_tokens - B * len(ids)
    if tail > 0:  # Claude Code: trailing tokens with no id are new content of this request only
        keys.append(block_key(f"tail/{req.source}", 0))
        lens.append(tail)
    return keys, lens


def cached_prefix_blocks(keys: list[int], seen: set[int]) -> int:
    """Leading blocks of ``keys`` already in ``seen``. Block keys are prefix hashes, so the seen
    blocks form a leading run (binary search); holds for the shared prefix too."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] in seen:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _sessions(trace: Trace, opts: ReplayOptions) -> list[TraceSession]:
    """The sessions replayed: from ``start``, at most ``max_sessions``, and for traces of
    sessions ``max_requests`` caps each session (its first requests; see :func:`_first_requests`)."""
    if trace.timed:
        return trace.sessions
    s = trace.sessions[opts.start:]
    s = s[: opts.max_sessions] if opts.max_sessions is not None else s
    return [_first_requests(x, opts.max_requests) for x in s] if opts.max_requests is not None else s


def _first_requests(sess: TraceSession, n: int) -> TraceSession:
    """The session cut after its first ``n`` requests: subagents started after them are dropped
    (a subagent that is kept runs whole)."""
    if len(sess.requests) <= n:
        return sess
    return replace(sess, requests=sess.requests[:n], subagents=[a for a in sess.subagents if a.after_index < n])


def _collapse(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """Drop the second of an ``s``/``n`` pair with equal ``hash_ids`` (one call made twice)."""
    out: list[TraceRequest] = []
    for r in reqs:
        if out and out[-1].hash_ids == r.hash_ids and {out[-1].call_type, r.call_type} == {"s", "n"}:
            continue
        out.append(r)
    return out


def _compress_idle(reqs: list[TraceRequest], max_idle_s: float | None) -> list[TraceRequest]:
    """In-session times with every gap between consecutive requests capped at ``max_idle_s``
    (a user away for hours would otherwise leave a session idle for the whole replay)."""
    if max_idle_s is None or not reqs:
        return reqs
    out, shift = [reqs[0]], 0.0
    for a, b in zip(reqs, reqs[1:]):
        shift += max(0.0, (b.t_s - a.t_s) - max_idle_s)
        out.append(replace(b, t_s=b.t_s - shift))
    return out


def _shifted(sub: Subagent, orig: list[TraceRequest], placed: list[TraceRequest], opts: ReplayOptions) -> Subagent:
    """The subagent with its start moved by the idle compression of the parent request it follows."""
    if opts.max_idle_s is None or not 0 <= sub.after_index < len(placed) or opts.collapse_pairs:
        return sub
    i = sub.after_index
    start = placed[i].t_s + min(opts.max_idle_s, sub.start_s - orig[i].t_s)
    return Subagent(start, i, sub.session)


def _session_items(sess: TraceSession, opts: ReplayOptions, scale: float) -> tuple[list[_Item], list[_Item]]:
    """Items of a session (subagents included) with in-session open-loop times and closed-loop
    dependencies; returns (items in time order, terminal items nobody in the session waits for)."""
    reqs = _collapse(sess.requests) if opts.collapse_pairs else sess.requests
    reqs = _compress_idle(reqs, opts.max_idle_s)
    items = [_Item(r, sess, i, r.t_s / scale) for i, r in enumerate(reqs)]
    for a, b in zip(items, items[1:]):
        b.after.append(a)
        gap = think_gap_s(b.req.t_s, b.req.think_time_s, a.req.t_s, a.req.api_time_s)
        b.gap_s = (gap if opts.max_idle_s is None else min(gap, opts.max_idle_s)) / scale
    out, terminals = list(items), set(id(x) for x in items[-1:])
    for sub in sess.subagents:
        sub = _shifted(sub, sess.requests, reqs, opts)
        sub_items, sub_terms = _session_items(sub.session, opts, scale)
        if not sub_items:
            continue
        idx = min(sub.after_index, len(items) - 1) if opts.collapse_pairs else sub.after_index
        parent = items[idx] if idx >= 0 and items else None
        for it in sub_items:
            it.arrival_s += sub.start_s / scale
        head = sub_items[0]
        if parent is not None:
            head.after.insert(0, parent)
            head.gap_s = max(0.0, sub.start_s - parent.req.t_s - (parent.req.api_time_s or 0.0)) / scale
        else:
            head.gap_s = sub.start_s / scale
        nxt = items[idx + 1] if idx + 1 < len(items) else None
        if nxt is not None:  # the parent's next request waits for the subagent
            nxt.after.extend(sub_terms)
            end = max(sub.start_s + t.req.t_s + (t.req.api_time_s or 0.0) for t in sub_terms)
            nxt.gap_s = min(nxt.gap_s, max(0.0, nxt.req.t_s - end) / scale)
        else:
            terminals.update(id(t) for t in sub_terms)
        out.extend(sub_items)
    out.sort(key=lambda x: x.arrival_s)
    return out, [x for x in out if id(x) in terminals]


def _place(trace: Trace, opts: ReplayOptions) -> list[_Item]:
    """All items in schedule order with arrivals (open loop) or dependencies (closed loop)."""
    sessions = _sessions(trace, opts)
    if trace.timed:
        sess = sessions[0]
        reqs = sess.requests[opts.start:]
        if opts.max_requests is not None:
            reqs = reqs[: opts.max_requests]
        arr = arrival_times([r.t_s * 1000.0 for r in reqs], opts.time_scale, opts.spread_ticks, opts.tick_ms)
        return [_Item(r, sess, opts.start + i, a, rid=f"r{opts.start + i}") for i, (r, a) in enumerate(zip(reqs, arr))]
    per = [_session_items(s, opts, opts.time_scale) for s in sessions]
    for s, (items, _) in zip(sessions, per):
        for k, it in enumerate(items):
            it.rid = f"{it.sess.id}#{it.index}"
    if opts.users is None:  # open loop
        if opts.session_rate is None:
            raise ValueError("open-loop replay needs session_rate (or users for a closed loop)")
        starts = poisson_starts(len(per), opts.session_rate, opts.seed)
        flat = []
        for s0, (items, _) in zip(starts, per):
            for it in items:
                it.arrival_s += s0
                it.after, it.gap_s = [], 0.0
            flat.extend(items)
        flat.sort(key=lambda x: x.arrival_s)
        return flat
    last: dict[int, list[_Item]] = {}
    flat = []
    for k, (items, terms) in enumerate(per):
        u = k % opts.users
        for it in items:
            it.arrival_s = 0.0
        roots = [it for it in items if not it.after]
        for it in roots:
            if u in last:
                it.after = list(last[u])
                it.gap_s = it.gap_s if it.gap_s and it is not items[0] else 0.0
        last[u] = terms
        flat.extend(_topological(items))
    return flat


def _topological(items: list[_Item]) -> list[_Item]:
    """``items`` in time order, moved only as far as needed to follow the requests they wait for."""
    done: set[int] = set()
    out: list[_Item] = []
    mine = {id(x) for x in items}

    def emit(x: _Item) -> None:
        if id(x) in done:
            return
        done.add(id(x))
        for d in x.after:
            if id(d) in mine:
                emit(d)
        out.append(x)
    for x in items:
        emit(x)
    return out


def build_schedule(trace: Trace, opts: ReplayOptions, vocab: Vocab) -> list[ReplayRequest]:
    """Convert ``trace`` into replay requests (see module docstring); ``ValueError`` for bad options."""
    opts.check(trace)
    items = _place(trace, opts)
    B = trace.block_tokens
    tpb = opts.tokens_per_block or B
    blocks = BlockTokens(vocab, opts.seed, block=B)
    pos = {id(it): i for i, it in enumerate(items)}
    keys_of = _Keys()
    seen: set[int] = set()
    out: list[ReplayRequest] = []
    for it in items:
        keys, tlens = trace_blocks(it.req, it.sess, B, opts, keys_of)
        truncated = False
        if opts.max_context is not None and it.req.input_tokens > opts.max_context:
            keep = truncate_blocks(tlens, opts.max_context)
            keys, tlens = (keys[:keep], tlens[:keep]) if keep else (keys[:1], [opts.max_context])
            truncated = True
        lens = [tpb] * (len(tlens) - 1) + [shrink(tlens[-1], B, tpb)]
        max_tokens = it.req.output_tokens if opts.max_output_tokens is None else min(
            it.req.output_tokens, opts.max_output_tokens)
        cap = opts.max_prompt_tokens
        if opts.context_len is not None:
            ctx = max(1, opts.context_len - max_tokens)
            cap = ctx if cap is None else min(cap, ctx)
        if cap is not None and sum(lens) > cap:
            keep = truncate_blocks(lens, cap)
            keys, lens, tlens = (keys[:keep], lens[:keep], tlens[:keep]) if keep else (keys[:1], [cap], tlens[:1])
            truncated = True
        input_trace = sum(tlens)
        hit = cached_prefix_blocks(keys, seen)
        cached = sum(tlens[:hit])
        seen.update(keys[hit:])
        reuse = cached / input_trace if input_trace else 0.0
        uncached = input_trace - cached
        out.append(ReplayRequest(
            id=it.rid, line=it.index, arrival_s=it.arrival_s, max_tokens=max_tokens, hash_ids=keys,
            block_lens=lens, input_length=it.req.input_tokens, reuse=reuse,
            trace_class="cold" if reuse < opts.cold_threshold else "warm", blocks=blocks,
            truncated=truncated, kind=request_kind(it.sess.role, reuse, uncached, opts), session=it.sess.id,
            after=tuple(sorted(pos[id(d)] for d in it.after)), gap_s=it.gap_s,
            cached_trace_tokens=cached, uncached_trace_tokens=uncached, source=it.req.source))
    return out


def request_kind(role: str, reuse: float, uncached_tokens: int, opts: ReplayOptions) -> str:
    """The 4-way kind (module docstring)."""
    if role != "main":
        return "subagent"
    if reuse < opts.cold_threshold:
        return "cold"
    return "warm_large" if uncached_tokens > opts.large_suffix_tokens else "warm_small"


def options_record(trace: Trace, opts: ReplayOptions, vocab: Vocab | None = None) -> dict[str, Any]:
    """What results files record about the trace and the replay settings."""
    rec: dict[str, Any] = {"trace": trace.path, "trace_format": trace.format, "trace_files": trace.files,
                           "trace_block_tokens": trace.block_tokens, "has_prefix_info": trace.has_prefix_info,
                           "arrival_model": opts.arrival_model(trace), **asdict(opts)}
    if vocab is not None:
        rec.update(vocab_size=vocab.size, vocab_source=vocab.source, n_special_ids=len(vocab.special_ids))
    return rec


def sim_blocks(req: ReplayRequest, tokens_per_block: int, sim_block_tokens: int) -> tuple[int, ...]:
    """Block ids of ``req`` in the simulator's block size: each group of
    ``sim_block_tokens / tokens_per_block`` replayed blocks is named by its last block's key (a
    prefix hash names the whole prefix up to it, so equal group ids mean equal prefixes)."""
    if sim_block_tokens % tokens_per_block:
        raise ValueError(f"simulator block size {sim_block_tokens} is not a multiple of the replayed "
                         f"block size {tokens_per_block}")
    f = sim_block_tokens // tokens_per_block
    keys = req.hash_ids
    out = [keys[j - 1] for j in range(f, len(keys) + 1, f)]
    if len(keys) % f:
        out.append(keys[-1])
    return tuple(out)
