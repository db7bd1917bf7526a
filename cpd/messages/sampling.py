"""The one sampling type: :class:`SamplingParams`.

The router front builds it from an OpenAI request, ``POST /prefill`` and ``POST /decode`` carry
it (its JSON encoding is its fields, :mod:`cpd.messages.worker_api`), the engine samples with it
(:mod:`cpd.engine.sampling`). Its constructor is the one validation of sampling values: a value
it refuses is refused when the request arrives (front: 400; worker: 400 on a malformed body),
never inside an engine step. Torch-free, so the router does not import torch for it.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any


def _finite_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    Attributes:
        temperature: 0 → greedy (argmax); > 0 → sample from ``softmax(logits / temperature)``
            (any finite positive value, however small, is safe).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 (or ≥ vocabulary size) disables.
        seed: any integer, makes sampling reproducible whatever path the request takes (:mod:`cpd.engine.sampling`); None → engine RNG.
        max_tokens: most tokens to generate (≥ 1).
        ignore_eos: do not stop on the model's EOS ids.
        stop_token_ids: extra ids that stop generation (the stop token is emitted).
    Raises:
        ValueError: on out-of-range or wrongly typed values (NaN / inf included), so a bad
            value is refused when the request arrives, never inside an engine step.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        temperature = _finite_real("temperature", self.temperature)
        top_p = _finite_real("top_p", self.top_p)
        top_k = _integer("top_k", self.top_k)
        max_tokens = _integer("max_tokens", self.max_tokens)
        seed = None if self.seed is None else _integer("seed", self.seed)
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not (0 < top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        stop_ids = tuple(_integer("stop_token_ids[]", t) for t in self.stop_token_ids)
        for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k),
                            ("max_tokens", max_tokens), ("seed", seed), ("ignore_eos", bool(self.ignore_eos)),
                            ("stop_token_ids", stop_ids)):
            object.__setattr__(self, name, value)


__all__ = ["SamplingParams"]
