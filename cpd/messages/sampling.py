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
        min_p: drop tokens whose probability is below ``min_p`` × the most likely token's;
            0 disables (vLLM's ``min_p``).
        repetition_penalty: > 0; a token that occurs in the prompt or the output so far has its
            logit divided by it where positive, multiplied where negative; 1 disables
            (vLLM/transformers semantics).
        presence_penalty: in [-2, 2]; subtracted from the logit of every token that occurs in
            the output so far (OpenAI semantics).
        frequency_penalty: in [-2, 2]; subtracted once per occurrence in the output so far
            (OpenAI semantics).
        min_tokens: the stop token ids (EOS included) cannot be sampled before this many
            tokens were generated, and stop strings do not end the output before it (vLLM);
            at most ``max_tokens``.
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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        temperature = _finite_real("temperature", self.temperature)
        top_p = _finite_real("top_p", self.top_p)
        top_k = _integer("top_k", self.top_k)
        max_tokens = _integer("max_tokens", self.max_tokens)
        min_p = _finite_real("min_p", self.min_p)
        repetition_penalty = _finite_real("repetition_penalty", self.repetition_penalty)
        presence_penalty = _finite_real("presence_penalty", self.presence_penalty)
        frequency_penalty = _finite_real("frequency_penalty", self.frequency_penalty)
        min_tokens = _integer("min_tokens", self.min_tokens)
        seed = None if self.seed is None else _integer("seed", self.seed)
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not (0 < top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 0 <= min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0 <= min_tokens <= max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        stop_ids = tuple(_integer("stop_token_ids[]", t) for t in self.stop_token_ids)
        checked: tuple[tuple[str, object], ...] = (
            ("temperature", temperature), ("top_p", top_p), ("top_k", top_k), ("min_p", min_p),
            ("repetition_penalty", repetition_penalty), ("presence_penalty", presence_penalty),
            ("frequency_penalty", frequency_penalty), ("min_tokens", min_tokens), ("max_tokens", max_tokens),
            ("seed", seed), ("ignore_eos", bool(self.ignore_eos)), ("stop_token_ids", stop_ids))
        for attr, checked_value in checked:
            object.__setattr__(self, attr, checked_value)

    @property
    def uses_history(self) -> bool:
        """Whether sampling depends on the tokens so far (a penalty is set)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


__all__ = ["SamplingParams"]
