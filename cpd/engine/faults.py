"""Test-only fault injection for the engine. Never set in production.

A live test needs a real worker process to fail a real request at a chosen place inside an
engine step, without mocks. The plan is read from the environment once, when the worker
starts (:meth:`FaultPlan.from_env`); an empty environment injects nothing.

- ``CPD_FAULT_SAMPLE_ERROR_SEED=N``: sampling raises for every request whose ``seed`` is N
  (a per-request failure: that request alone must fail).
- ``CPD_FAULT_STEP_ERROR_SEED=N``: the model forward raises in every step that schedules a
  request whose ``seed`` is N (a whole-step failure: the step's requests fail, the engine
  keeps serving the others and new ones).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping

SAMPLE_ERROR_ENV = "CPD_FAULT_SAMPLE_ERROR_SEED"
STEP_ERROR_ENV = "CPD_FAULT_STEP_ERROR_SEED"


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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "FaultPlan":
        env = os.environ if env is None else env
        return cls(_seed_env(env, SAMPLE_ERROR_ENV), _seed_env(env, STEP_ERROR_ENV))

    @property
    def active(self) -> bool:
        return self.sample_error_seed is not None or self.step_error_seed is not None

    def check_sample(self, seed: int | None) -> None:
        """Raise :class:`InjectedFault` if sampling for a request with this seed must fail."""
        if seed is not None and seed == self.sample_error_seed:
            raise InjectedFault(f"injected sampling fault (seed {seed})")

    def check_step(self, seeds: Iterable[int | None]) -> None:
        """Raise :class:`InjectedFault` if a step scheduling these requests must fail."""
        if self.step_error_seed is not None and self.step_error_seed in set(seeds):
            raise InjectedFault(f"injected step fault (seed {self.step_error_seed})")
