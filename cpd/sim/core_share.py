"""Co-located workers sharing CPU cores: processor sharing of their engine steps (issue 10).

The simulator gives every engine its own device by default. A live deployment on a small
machine (``cpd serve`` with 3 workers on 2 cores, one torch thread each) does not: while more
workers compute than there are cores, each progresses at ``cores / busy`` of its own speed
(the kernel's fair scheduler shares a core's time among runnable threads of equal weight).

:class:`CoreShare` is that rule on a virtual clock, and nothing else: a step starts with its
*work* (the cost model's step time: what it takes with a core to itself), all running steps
progress at ``min(1, cores / len(running))``, and :meth:`finish_times` says when each ends if
nothing else starts or ends. The caller (:class:`cpd.sim.engine_sim.EngineSimulator`)
reschedules the running steps' completions whenever the set changes.

What it does not model: other processes' CPU (router, load generator), cache and memory
bandwidth contention between cores, and a worker's own threads besides its compute thread.
"""
from __future__ import annotations


class CoreShare:
    """Processor sharing of ``cores`` cores among running steps (module docstring)."""

    def __init__(self, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.cores = cores
        self._remaining_s: dict[str, float] = {}  # step owner -> work left (s at full speed)
        self._t = 0.0

    @property
    def running(self) -> int:
        return len(self._remaining_s)

    def rate(self) -> float:
        """The speed of each running step now (1.0: a core to itself)."""
        n = len(self._remaining_s)
        return 1.0 if n <= self.cores else self.cores / n

    def _advance(self, now: float) -> None:
        if now < self._t:
            raise ValueError(f"time went back: {now} < {self._t}")
        done = (now - self._t) * self.rate()
        for k in self._remaining_s:
            self._remaining_s[k] = max(0.0, self._remaining_s[k] - done)
        self._t = now

    def start(self, now: float, owner: str, work_s: float) -> None:
        """A step of ``work_s`` (at full speed) starts for ``owner`` (one step per owner)."""
        if owner in self._remaining_s:
            raise ValueError(f"{owner} already runs a step")
        self._advance(now)
        self._remaining_s[owner] = max(0.0, work_s)

    def finish(self, now: float, owner: str) -> None:
        """``owner``'s step ended (at its finish time)."""
        self._advance(now)
        del self._remaining_s[owner]

    def finish_times(self) -> dict[str, float]:
        """Each running step's end if the running set stays as it is."""
        r = self.rate()
        return {k: self._t + rem / r for k, rem in self._remaining_s.items()}
