"""A worker's expected costs from its cost model: what it advertises to the router (issue 11/10).

A live router prices queues and loads with a :class:`~cpd.policy.routing.LinearCostModel` that it
learns from the prefills and loads workers report (:mod:`cpd.router.estimates`). Before the first
answers come back it had only its configured defaults (2,000 prompt tokens/s, L3 1 GB/s), which
for a modeled deployment of a 70B model on an H100 at time dilation K = 3 priced the first
prefills ~1.75× too fast (docs/results/modeled_ordering/README.md, "Session 11 rerun"). A worker
whose step times come from a cost model knows better: :func:`cost_prior` turns that model, the
engine's token budget and the time dilation into the :class:`~cpd.messages.worker_api.CostPrior`
it reports in ``GET /info``.

The prefill cost has a *shape* and a *scale*. The shape (``attn_coeff``: a context token's
attention cost relative to a token's linear cost) is a property of the model architecture, known
up front (the cost model's ``prefill_attn_coeff``); the scale (``prefill_tokens_per_s``, tokens
without attention context per second, :func:`cpd.policy.routing.prefill_scale_tokens_per_s`) is
what the router measures. The advertised scale is that of one *full prefill step*:
``max_num_batched_tokens`` prompt tokens in chunks of ``max_prefill_chunk_tokens``, no cached
prefix. The router's EWMA samples the same quantity (the engine's rate over the steps a prefill
ran in, normalised by the shape), so measurements continue the prior instead of jumping away
from it. Bandwidths are the model's links (``L2``: host pool,
``L3``: store); a tier the model cannot price (a calibrated profile that did not measure it) is
left out. All figures are wall-clock: the model's rates divided by ``time_dilation``.
"""
from __future__ import annotations

from typing import Any

from cpd.messages.worker_api import CostPrior
from cpd.policy.routing import LinearCostModel, prefill_scale_tokens_per_s, prefill_work_tokens


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
    attn = prefill_attn_coeff(cost_model)
    work = sum(prefill_work_tokens(n, p, attn or 0.0) for n, p in chunks)
    rate = work / step_s if step_s > 0 else None
    links: dict[str, float | None] = {}
    for tier in ("L2", "L3"):
        try:
            links[tier] = cost_model.link_bytes_per_s(tier) / time_dilation
        except (KeyError, ValueError):  # a calibrated profile without that tier
            links[tier] = None
    return CostPrior(prefill_tokens_per_s=rate, attn_coeff=attn, l2_bytes_per_s=links["L2"],
                     l3_bytes_per_s=links["L3"], source=source)


def prefill_attn_coeff(cost_model: Any) -> float | None:
    """The shape of ``cost_model``'s prefill cost (its ``prefill_attn_coeff``: the architecture's
    for a roofline, the fitted ``c / b`` for a calibrated profile); None when it has none."""
    attn = getattr(cost_model, "prefill_attn_coeff", None)
    return float(attn) if isinstance(attn, (int, float)) and attn >= 0 else None


def linear_router_cost(cost_model: Any, num_new_tokens: int, num_cached_tokens: int,
                       shaped: bool = True) -> LinearCostModel:
    """A :class:`LinearCostModel` for ``cost_model``'s engine: its prefill shape (``shaped``; else
    ``attn_coeff`` 0, one plain rate) and the scale of one prefill of ``num_new_tokens`` on
    ``num_cached_tokens`` (a typical turn), its L2 / L3 links and latencies. The simulator's
    ``"linear"`` router cost (:func:`cpd.sim.experiment.router_cost`)."""
    attn = (prefill_attn_coeff(cost_model) or 0.0) if shaped else 0.0
    seconds = cost_model.prefill_time_s(num_new_tokens, num_cached_tokens)
    rate = prefill_scale_tokens_per_s(num_new_tokens, num_cached_tokens, seconds, attn)
    return LinearCostModel(kv_bytes_per_token=cost_model.kv_bytes_per_token, prefill_tokens_per_s=rate,
                           attn_coeff=attn, l2_bytes_per_s=cost_model.link_bytes_per_s("L2"),
                           l3_bytes_per_s=cost_model.link_bytes_per_s("L3"),
                           l2_overhead_s=cost_model.link_latency_s("L2"),
                           l3_overhead_s=cost_model.link_latency_s("L3"))


__all__ = ["cost_prior", "full_step_prefill_chunks", "linear_router_cost", "prefill_attn_coeff"]
