"""Sampling parameters and token sampling.

Logits are adjusted first (:func:`adjust_logits`): repetition, presence and frequency
penalties over the tokens so far, and the stop ids masked while fewer than ``min_tokens``
tokens were generated. Then greedy when ``temperature == 0``; otherwise temperature scaling,
optional top-k, top-p (nucleus) and min-p filtering, then a draw from the softmax. The
adjustments depend only on the request's own tokens, so every path (one engine, or prefill
here and decode after a handoff) picks the same token. With a ``seed`` the draw
for the ``i``-th generated token uses a fresh ``torch.Generator`` seeded from
``(seed, i)``, so a seeded request gives the same tokens whatever path it takes
(one engine, or prefill on one engine and decode on another after a handoff).
Stop *strings* are the router's job; the engine stops on stop token ids (EOS).

Numerical safety (issue 7 §2): :func:`sample` returns a valid token id and never raises
for every value :class:`SamplingParams` accepts and for any logits the model produces:

- logits are cleaned first (:func:`_clean_logits`): NaN counts as ``-inf``; if some logits
  are ``+inf`` only those tokens stay possible; if no token is possible at all (every logit
  NaN / ``-inf``) every token is equally likely;
- scaling is done in float64 *after* subtracting the maximum, ``(x - max) / T``: the most
  likely token's scaled logit is exactly 0 and every other one is ``<= 0`` (or ``-inf``), so
  a tiny temperature such as ``1e-300`` underflows the others to probability 0 (≈ greedy,
  ties drawn uniformly) instead of overflowing to ``inf``/NaN;
- top-k and top-p always keep the most likely token, so the distribution keeps mass > 0.
"""
from __future__ import annotations

import torch

from cpd.engine.executor import TokenHistory
from cpd.messages.sampling import SamplingParams  # the one sampling type (re-exported)


def _mix_seed(seed: int, index: int) -> int:
    # splitmix64-style mixing of (seed, index) into a 63-bit generator seed (any int seed)
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


def _clean_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as CPU float64 with a finite maximum (see module docstring)."""
    x = logits.detach().to("cpu", torch.float64).reshape(-1)
    x = x.masked_fill(torch.isnan(x), float("-inf"))
    pos_inf = torch.isposinf(x)
    if bool(pos_inf.any()):
        x = torch.zeros_like(x).masked_fill(~pos_inf, float("-inf"))
    if not bool(torch.isfinite(x).any()):
        x = torch.zeros_like(x)
    return x


def adjust_logits(x: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """Penalties and banned ids applied to cleaned float64 logits ``x`` (a new tensor). A ban
    that would leave no possible token leaves the allowed tokens equally likely instead; a ban
    of every id (every id a stop id under ``min_tokens``) cannot hold and is not applied (the
    engine still does not stop before ``min_tokens``)."""
    vocab = x.shape[-1]
    if params.uses_history and history.token_ids:
        ids = torch.as_tensor(history.token_ids, dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < vocab)]
        out_ids = ids[history.prompt_len:] if history.prompt_len <= len(history.token_ids) else ids[:0]
        x = x.clone()
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
            p = params.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
        if out_ids.numel() and (params.presence_penalty or params.frequency_penalty):
            counts = torch.bincount(out_ids, minlength=vocab).to(torch.float64)
            x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        x = _clean_logits(x)  # an extreme penalty may overflow to ±inf: the cleaning rules again
    banned = [t for t in history.banned_ids if 0 <= t < vocab]
    if banned:
        ids = torch.as_tensor(banned, dtype=torch.int64)
        kept = x.index_fill(0, ids, float("-inf"))
        if not bool(torch.isfinite(kept).any()):
            kept = torch.zeros_like(x).index_fill_(0, ids, float("-inf"))
        if bool(torch.isfinite(kept).any()):  # else every id is banned: keep x as it is
            x = kept
    return x


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of ``[n, vocab_size]`` logits, NaN counting as ``-inf`` (the same
    token :func:`sample` picks at temperature 0)."""
    x = logits.masked_fill(torch.isnan(logits), float("-inf"))
    return x.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, params: SamplingParams, output_index: int,
           generator: torch.Generator | None = None, history: TokenHistory | None = None) -> int:
    """Pick the next token.

    Args:
        logits: ``[vocab_size]`` float logits (any device, any values incl. NaN / ±inf).
        params: sampling parameters.
        output_index: index of the token being generated (0 = first output token);
            used with ``params.seed``.
        generator: CPU generator used when ``params.seed`` is None.
        history: the request's tokens and banned ids (penalties, ``min_tokens``); None: none.
    Returns:
        A token id in ``[0, vocab_size)``.
    """
    if params.temperature == 0 and history is None:
        return greedy_tokens(logits.reshape(1, -1))[0]
    x = _clean_logits(logits)
    if history is not None:
        x = adjust_logits(x, params, history)
    if params.temperature == 0:
        return int(x.argmax().item())
    x = (x - x.max()) / params.temperature  # max → 0, others ≤ 0 or -inf: never inf/NaN
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, 0)
        drop = (cum - sp) >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        drop[0] = False
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)  # the max always stays
    if params.seed is not None:
        generator = torch.Generator().manual_seed(_mix_seed(params.seed, output_index))
    return int(torch.multinomial(probs, 1, generator=generator).item())
