"""The one arrival model of trace replay, used by ``cpd bench`` (live) and ``cpd simulate``.

* **Timed traces** (Mooncake, Azure): ``arrival = (timestamp - first) / time_scale``; with
  ``spread_ticks`` the ``m`` requests sharing one timestamp ``t`` get ``t + i * w / m``, where
  ``w`` is ``tick_ms`` capped by the gap to the next distinct timestamp (order is kept). Load is
  scaled by stretching time, never by dropping requests.
* **Sessions, open loop** (``session_rate`` R): session starts are a Poisson process at rate R
  (``random.Random(seed)``, first session at 0); within a session the trace's ``t`` is kept
  (divided by ``time_scale``).
* **Sessions, closed loop** (``users`` N): session ``k`` belongs to user ``k % N``; a request is
  sent ``gap_s`` after every request it depends on (``after``) has finished: the previous request
  of its (sub)agent, the subagents its parent waits for, or, for the first request of a session,
  the last requests of that user's previous session. The gap is the trace's ``think_time``
  (else ``t`` minus the previous request's ``t + api_time``, at least 0), divided by ``time_scale``.
"""
from __future__ import annotations

import random
from typing import Sequence

DEFAULT_TICK_MS = 3000.0


def arrival_times(timestamps_ms: Sequence[float], time_scale: float = 1.0, spread_ticks: bool = False,
                  tick_ms: float = DEFAULT_TICK_MS) -> list[float]:
    """Arrival offsets (s) of a timed trace, relative to its first timestamp (see module docstring)."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    ts = [float(t) for t in timestamps_ms]
    if any(b < a for a, b in zip(ts, ts[1:])):
        raise ValueError("timestamps must be non-decreasing")
    if spread_ticks and ts:
        out = list(ts)
        i = 0
        while i < len(ts):
            j = i
            while j < len(ts) and ts[j] == ts[i]:
                j += 1
            width = tick_ms if j == len(ts) else min(tick_ms, ts[j] - ts[i])
            m = j - i
            for k in range(m):
                out[i + k] = ts[i] + k * width / m
            i = j
        ts = out
    t0 = ts[0] if ts else 0.0
    return [(t - t0) / 1000.0 / time_scale for t in ts]


def poisson_starts(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """``n`` session start times (s) of a Poisson process at ``rate_per_s``; the first at 0."""
    if rate_per_s <= 0:
        raise ValueError("session_rate must be > 0")
    rng = random.Random(seed)
    out, t = [], 0.0
    for k in range(n):
        if k:
            t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def think_gap_s(t_s: float, think_time_s: float | None, prev_t_s: float, prev_api_time_s: float | None) -> float:
    """Closed-loop pause before a request: ``think_time`` if the trace has it, else ``t`` minus the
    previous request's ``t + api_time`` (``api_time`` 0 when absent), never below 0."""
    if think_time_s is not None:
        return think_time_s
    return max(0.0, t_s - prev_t_s - (prev_api_time_s or 0.0))
