"""A worker's expected costs from its cost model: what it advertises to the router (issue 11/10).

A live router prices queues and loads with a :class:`~cpd.policy.routing.LinearCostModel` that it
learns from the prefills and loads workers report (:mod:`cpd.router.estimates`). Before the first
answers come back it had only its configured defaults (2,000 prompt tokens/s, L3 1 GB/s), which
for a modeled deployment of a 70B model on an H100 at time dilation K = 3 priced the first
prefills ~1.75× too fast (docs/results/modeled_ordering/README.md, "Session 11 rerun"). A worker
whose step times come from a cost model knows better: :func:`cost_prior` turns that model, the
engine's token budget and the time dilation into the :class:`~cpd.messages.worker_api.CostPrior`
it reports in ``GET /info``.

The prefill rate is the rate of one *full prefill step*: ``max_num_batched_tokens`` prompt tokens
in chunks of ``max_prefill_chunk_tokens``, no cached prefix. That is the quantity the router's
EWMA samples (``step_tokens / step_s`` of the steps a prefill ran in), so measurements continue
the prior instead of jumping away from it. Bandwidths are the model's links (``L2``: host pool,
``L3``: store); a tier the model cannot price (a calibrated profile that did not measure it) is
left out. All figures are wall-clock: the model's rates divided by ``time_dilation``.
"""
from __future__ import annotations

from typing import Any

from cpd.messages.worker_api import CostPrior


def full_step_prefill_chunks(max_num_batched_tokens: int, max_prefill_chunk_tokens: int) -> list[tuple[int, int]]:
    """``(new, cached)`` chunks of one full prefill step: the token budget in chunks of at most
    ``max_prefill_chunk_tokens``, none on a cached prefix."""
    budget = max(1, int(max_num_batched_tokens))
    chunk = max(1, min(int(max_prefill_chunk_tokens), budget))
    chunks = [(chunk, 0)] * (budget // chunk)
    if budget % chunk:
        chunks.append((budget % chunk, 0))
    return chunks


def cost_prior(cost_model: Any, *, time_dilation: float = 1.0, max_num_batched_tokens: int,
               max_prefill_chunk_tokens: int, source: str = "") -> CostPrior:
    """The :class:`CostPrior` of an engine whose step times are ``cost_model``'s (a
    :class:`~cpd.policy.cost_model.RooflineCostModel` or
    :class:`~cpd.costmodel.calibrated.CalibratedCostModel`: ``step_time_s`` and
    ``link_bytes_per_s``) stretched ``time_dilation`` times.

    Raises:
        ValueError: ``time_dilation`` not > 0.
    """
    if time_dilation <= 0:
        raise ValueError("time_dilation must be > 0")
    chunks = full_step_prefill_chunks(max_num_batched_tokens, max_prefill_chunk_tokens)
    step_s = cost_model.step_time_s(chunks) * time_dilation
    rate = sum(n for n, _ in chunks) / step_s if step_s > 0 else None
    links: dict[str, float | None] = {}
    for tier in ("L2", "L3"):
        try:
            links[tier] = cost_model.link_bytes_per_s(tier) / time_dilation
        except (KeyError, ValueError):  # a calibrated profile without that tier
            links[tier] = None
    return CostPrior(prefill_tokens_per_s=rate, l2_bytes_per_s=links["L2"], l3_bytes_per_s=links["L3"],
                     source=source)


__all__ = ["cost_prior", "full_step_prefill_chunks"]
