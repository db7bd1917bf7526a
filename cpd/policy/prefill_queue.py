"""A worker's dispatched prefills as the router predicts them: the ``queued_prefill_s`` of its
:class:`~cpd.policy.routing.WorkerLoad` (the live router's :class:`cpd.router.workers.WorkerInfo`
and the simulator keep one each; one truth for both).

Each prefill counts with its own estimate (``work_s``) from its dispatch until its first token.
With ``count_elapsed`` a prefill that has started computing counts only its *remaining* estimate:
its estimate minus the seconds since it started, floored at 0. Counting the whole estimate until
the first token made a prefill worker that had done most of a long prefill look as busy as one
that had not started it (docs/sim_results/adaptive_grid/session17/, "With an exact cost model the
miss remains"). Pure bookkeeping: the caller says when (``now_s``) and what started: the
simulator at the engine step that starts computing it (``cpd.sim.engine_sim``, experiment key
``queue_remaining``), the live router at the first progress line of its ``POST /prefill`` that
reports it running (``cpd.router.dispatch``, ``router.queue_remaining``; lines come every 0.5 s,
so the live router counts up to 0.5 s more of it). A decode-local append counts whole (its
stream reports no start).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class QueuedPrefills:
    """Estimates of the prefills dispatched to one worker, until their first token."""

    count_elapsed: bool = False
    _est_s: dict[Hashable, float] = field(default_factory=dict)
    _started_s: dict[Hashable, float] = field(default_factory=dict)
    _sum_s: float = 0.0  # the running sum of the estimates (what count_elapsed=False reports)

    def add(self, key: Hashable, est_s: float) -> None:
        """``key`` dispatched with own work ``est_s`` (seconds)."""
        self.remove(key)
        self._est_s[key] = est_s
        self._sum_s += est_s

    def start(self, key: Hashable, now_s: float) -> None:
        """``key`` started computing at ``now_s`` (the first report counts; unknown keys: nothing)."""
        if key in self._est_s:
            self._started_s.setdefault(key, now_s)

    def remove(self, key: Hashable) -> None:
        """``key``'s first token (or its end without one)."""
        if key in self._est_s:
            self._sum_s -= self._est_s.pop(key)
        self._started_s.pop(key, None)

    def unstarted(self) -> list[Hashable]:
        """Keys not reported started yet."""
        return [k for k in self._est_s if k not in self._started_s]

    def queued_s(self, now_s: float) -> float:
        """Predicted work ahead of a new prefill (seconds)."""
        if not self.count_elapsed:
            return max(0.0, self._sum_s)
        return sum(remaining_s(est, self._started_s.get(k), now_s) for k, est in self._est_s.items())

    def __len__(self) -> int:
        return len(self._est_s)


def remaining_s(est_s: float, started_s: float | None, now_s: float) -> float:
    """A prefill's remaining estimate: all of it before it starts, then less the time since."""
    if started_s is None:
        return est_s
    return max(0.0, est_s - max(0.0, now_s - started_s))


__all__ = ["QueuedPrefills", "remaining_s"]
