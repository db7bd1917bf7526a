"""Sampling parameters and token sampling.

Greedy when ``temperature == 0``; otherwise temperature scaling, optional top-k and
top-p (nucleus) filtering, then a draw from the softmax. With a ``seed`` the draw
for the ``i``-th generated token uses a fresh ``torch.Generator`` seeded from
``(seed, i)``, so a seeded request gives the same tokens whatever path it takes
(one engine, or prefill on one engine and decode on another after a handoff).
Stop *strings* are the router's job; the engine stops on stop token ids (EOS).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping.

    Attributes:
        temperature: 0 → greedy (argmax); > 0 → sample from ``softmax(logits / temperature)``.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables.
        seed: makes sampling reproducible (see module docstring); None → engine RNG.
        max_tokens: most tokens to generate (≥ 1).
        ignore_eos: do not stop on the model's EOS ids.
        stop_token_ids: extra ids that stop generation (the stop token is emitted).
    Raises:
        ValueError: on out-of-range values.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


def _mix_seed(seed: int, index: int) -> int:
    # splitmix64-style mixing of (seed, index) into a 63-bit generator seed
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def sample(logits: torch.Tensor, params: SamplingParams, output_index: int,
           generator: torch.Generator | None = None) -> int:
    """Pick the next token.

    Args:
        logits: ``[vocab_size]`` float logits (any device; moved to CPU float32).
        params: sampling parameters.
        output_index: index of the token being generated (0 = first output token);
            used with ``params.seed``.
        generator: CPU generator used when ``params.seed`` is None.
    Returns:
        The token id.
    """
    if params.temperature == 0:
        return int(torch.argmax(logits).item())
    x = logits.detach().to("cpu", torch.float32) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, 0)
        drop = (cum - sp) > params.top_p  # keep the smallest prefix whose mass reaches top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    if params.seed is not None:
        generator = torch.Generator().manual_seed(_mix_seed(int(params.seed), output_index))
    return int(torch.multinomial(probs, 1, generator=generator).item())
