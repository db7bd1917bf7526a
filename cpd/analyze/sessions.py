"""Session profile of a trace that has sessions (Claude Code conversations): how many requests a
session makes (its subagents' included), how long it lasts, how many subagents it starts, and how
its prompt grows. Mooncake and Azure files read as one session of absolute arrivals,
so the profile applies to ``Trace.timed == False`` traces only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cpd.traces.model import Trace, TraceSession


@dataclass(frozen=True)
class SessionStats:
    """One conversation: requests (subagents' included), duration from its first to its last
    request (``t`` offsets plus the last request's ``api_time`` when the trace gives it),
    subagents started, and its first and largest prompt (trace tokens)."""

    num_requests: int
    duration_s: float
    num_subagents: int
    first_input_tokens: int
    max_input_tokens: int


def _all_requests(s: TraceSession, offset_s: float = 0.0):
    for r in s.requests:
        yield offset_s + r.t_s, r
    for a in s.subagents:
        yield from _all_requests(a.session, offset_s + a.start_s)


def _count_subagents(s: TraceSession) -> int:
    return sum(1 + _count_subagents(a.session) for a in s.subagents)


def session_stats(s: TraceSession) -> SessionStats:
    reqs = sorted(_all_requests(s), key=lambda x: x[0])
    t_end = max(t + (r.api_time_s or 0.0) for t, r in reqs)
    return SessionStats(num_requests=len(reqs), duration_s=max(0.0, t_end - reqs[0][0]),
                        num_subagents=_count_subagents(s), first_input_tokens=reqs[0][1].input_tokens,
                        max_input_tokens=max(r.input_tokens for _, r in reqs))


def sessions_section(trace: Trace, out: Path) -> list[str]:
    """Report lines (and ``sessions.png``) for a trace of sessions; ``[]`` for timed traces."""
    from cpd.analyze.stats import _pct
    if trace.timed or not trace.sessions:
        return []
    st = [session_stats(s) for s in trace.sessions if s.requests]
    n = [x.num_requests for x in st]
    d = [x.duration_s / 60 for x in st]
    grow = [x.max_input_tokens / max(1, x.first_input_tokens) for x in st]
    with_sub = sum(1 for x in st if x.num_subagents) / len(st)
    _plot(st, out)
    return ["", "## Sessions", "",
            f"* {len(st)} sessions; requests per session p50/p90/max: {_pct(n, .5):.0f} / {_pct(n, .9):.0f} / {max(n)}",
            f"* session duration p50/p90/max: {_pct(d, .5):.1f} / {_pct(d, .9):.1f} / {max(d):.1f} min "
            "(first request to the end of the last one, within the session's own clock)",
            f"* sessions that start subagents: {with_sub * 100:.0f} %; subagents in all: "
            f"{sum(x.num_subagents for x in st)}",
            f"* prompt growth (largest / first prompt) p50/p90: {_pct(grow, .5):.1f}× / {_pct(grow, .9):.1f}×",
            "", "![sessions](sessions.png)"]


def _plot(st: list[SessionStats], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].hist([x.num_requests for x in st], bins=40)
    ax[0].set_xlabel("requests per session (subagents included)")
    ax[0].set_ylabel("sessions")
    d = sorted(x.duration_s / 60 for x in st)
    ax[1].plot(d, [i / len(d) for i in range(len(d))])
    ax[1].set_xscale("symlog")
    ax[1].set_xlabel("session duration (min)")
    ax[1].set_ylabel("CDF")
    fig.tight_layout()
    fig.savefig(out / "sessions.png", dpi=100)
    plt.close(fig)
