"""Measured inputs of the live cost model (docs/architecture.md 'Load versus recompute').

Exponentially weighted moving averages (EWMA, weight ``alpha`` on the newest sample)
of the prefill rate and of the effective bandwidth per tier, from what workers
report on every prefill. The pure policy reads a frozen
:class:`cpd.policy.routing.LinearCostModel` built from them (:meth:`CostEstimates.model`).
"""
from __future__ import annotations

from dataclasses import replace

from cpd.policy.routing import LinearCostModel


class CostEstimates:
    """EWMA estimates; start from ``initial`` and move with each observation."""

    def __init__(self, initial: LinearCostModel, alpha: float = 0.2):
        self._m = initial
        self.alpha = alpha

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def observe_prefill(self, num_computed_tokens: int, num_loaded_tokens: int, compute_s: float) -> None:
        """One prefill's computed tokens and its compute time (seconds, queueing excluded
        where the worker reports it)."""
        if num_computed_tokens >= 16 and compute_s > 0:
            rate = num_computed_tokens / compute_s
            self._m = replace(self._m, prefill_tokens_per_s=self._ewma(self._m.prefill_tokens_per_s, rate))

    def observe_transfer(self, tier: str, num_bytes: int, seconds: float) -> None:
        """One measured load from ``tier`` (``L2`` or ``L3``)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        bw = num_bytes / seconds
        if tier == "L2":
            self._m = replace(self._m, l2_bytes_per_s=self._ewma(self._m.l2_bytes_per_s, bw))
        elif tier == "L3":
            self._m = replace(self._m, l3_bytes_per_s=self._ewma(self._m.l3_bytes_per_s, bw))

    def model(self) -> LinearCostModel:
        return self._m
