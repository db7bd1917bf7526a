"""Test-only fault injection for the engine. Never set in production.

A live test needs a real worker process to fail a real request at a chosen place inside an
engine step, without mocks. The plan is read from the environment once, when the worker
starts (:meth:`FaultPlan.from_env`); an empty environment injects nothing.

- ``CPD_FAULT_SAMPLE_ERROR_SEED=N``: sampling raises for every request whose ``seed`` is N
  (a per-request failure: that request alone must fail).
- ``CPD_FAULT_STEP_ERROR_SEED=N``: the model forward raises in every step that schedules a
  request whose ``seed`` is N (a bad request that breaks the batched forward: the engine must trace
  it and fail it alone; its batch neighbours and the engine go on).
- ``CPD_FAULT_BREAK_SEED=N``: the first step that schedules a request whose ``seed`` is N breaks
  the engine for good: that step and every later one fail (a device that broke: only a new
  process clears it). The worker then fails whatever it runs. With ``CPD_FAULT_BREAK_S=S`` the
  break heals ``S`` seconds after it began (a transient device fault).
- ``CPD_FAULT_STEP_HANG_SEED=N``: the model forward blocks (never returns, or for
  ``CPD_FAULT_STEP_HANG_S`` seconds when that is set) in every step that schedules a request whose
  ``seed`` is N: a stuck engine (a hung kernel, a deadlock) while the worker's event loop lives.
- ``CPD_FAULT_WORKER=ID``: the faults above apply in the worker ``ID`` only (unset: in every
  process that reads the plan), so that a test can break one worker and retry on the others.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

SAMPLE_ERROR_ENV = "CPD_FAULT_SAMPLE_ERROR_SEED"
STEP_ERROR_ENV = "CPD_FAULT_STEP_ERROR_SEED"
BREAK_ENV = "CPD_FAULT_BREAK_SEED"
BREAK_S_ENV = "CPD_FAULT_BREAK_S"
STEP_HANG_ENV = "CPD_FAULT_STEP_HANG_SEED"
STEP_HANG_S_ENV = "CPD_FAULT_STEP_HANG_S"
WORKER_ENV = "CPD_FAULT_WORKER"


class InjectedFault(RuntimeError):
    """Raised where a :class:`FaultPlan` asks for a failure."""


def _seed_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value else None


@dataclass(frozen=True)
class FaultPlan:
    """Where to fail (seeds of the requests that trigger each fault; None = never)."""

    sample_error_seed: int | None = None
    step_error_seed: int | None = None
    step_hang_seed: int | None = None
    step_hang_s: float | None = None  # None: the hang never ends
    break_seed: int | None = None
    break_s: float | None = None  # None: the break never heals
    _broken_at: list = field(default_factory=list, compare=False, repr=False)  # [monotonic start] once broken

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, worker_id: str | None = None) -> "FaultPlan":
        """The plan of the process ``worker_id`` (None: any) from ``env`` (default: the environment)."""
        env = os.environ if env is None else env
        target = env.get(WORKER_ENV, "").strip()
        if target and target != worker_id:
            return cls()
        hang_s, break_s = env.get(STEP_HANG_S_ENV, "").strip(), env.get(BREAK_S_ENV, "").strip()
        return cls(_seed_env(env, SAMPLE_ERROR_ENV), _seed_env(env, STEP_ERROR_ENV), _seed_env(env, STEP_HANG_ENV),
                   float(hang_s) if hang_s else None, _seed_env(env, BREAK_ENV), float(break_s) if break_s else None)

    @property
    def active(self) -> bool:
        return any(s is not None for s in (self.sample_error_seed, self.step_error_seed, self.step_hang_seed,
                                           self.break_seed))

    def check_sample(self, seed: int | None) -> None:
        """Raise :class:`InjectedFault` if sampling for a request with this seed must fail."""
        if seed is not None and seed == self.sample_error_seed:
            raise InjectedFault(f"injected sampling fault (seed {seed})")

    def check_step(self, seeds: Iterable[int | None]) -> None:
        """Raise :class:`InjectedFault` if a step scheduling these requests must fail (or the engine
        is broken: every step fails); block (forever, or ``step_hang_s``) if it must hang."""
        if self.step_error_seed is None and self.step_hang_seed is None and self.break_seed is None:
            return
        seeds = set(seeds)
        if self.break_seed is not None and self.break_seed in seeds and not self._broken_at:
            self._broken_at.append(time.monotonic())
        if self._broken_at and (self.break_s is None or time.monotonic() - self._broken_at[0] < self.break_s):
            raise InjectedFault(f"injected broken engine (since a step with seed {self.break_seed})")
        if self.step_hang_seed is not None and self.step_hang_seed in seeds:
            threading.Event().wait(self.step_hang_s)  # nothing sets it: a step that does not return
        if self.step_error_seed is not None and self.step_error_seed in seeds:
            raise InjectedFault(f"injected step fault (seed {self.step_error_seed})")
