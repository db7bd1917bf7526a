"""The shape of prefill cost is the architecture's, only its scale is measured (issue 11, session 18).

The router priced prefill with one rate. Fitted at a warm turn (2 K new tokens on 100 K cached,
every token attending to ~100 K) it priced a cold 60-100 K-token prompt at 1.7-2.3x its roofline
time, and rule A3 held such prompts at home as "hopeless" while an idle prefill worker would have
met a 1 s SLO (docs/sim_results/adaptive_grid/session17/). The attention cost per context token
relative to a token's linear cost (``attn_coeff``) follows from the model's shapes; workers
advertise it (``CostPrior.attn_coeff``), the simulator's ``"linear"`` router cost takes it from the
roofline's architecture, and the router's EWMA samples are normalised by it, so a cold prefill
and a warm turn sample the same scale.
"""
from __future__ import annotations

import msgspec
import pytest

from cpd.costmodel.prior import cost_prior, linear_router_cost
from cpd.policy.cost_model import RooflineCostModel
from cpd.policy.routing import LinearCostModel, prefill_work_tokens
from cpd.router.estimates import CostEstimates

ROOFLINE = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=4)  # the adaptive grid's reference_b200
WARM = (2000, 100_000)  # a typical agent turn: 2 K new tokens on 100 K cached


def _shaped() -> LinearCostModel:
    return linear_router_cost(ROOFLINE, *WARM)


def test_the_shape_is_attention_flops_per_context_token_over_linear_flops():
    m = ROOFLINE.model
    assert m.prefill_attn_coeff == pytest.approx(4 * m.num_layers * m.num_heads * m.head_dim / (2 * m.linear_params))
    assert ROOFLINE.prefill_attn_coeff == m.prefill_attn_coeff
    assert prefill_work_tokens(1000, 0, 0.0) == 1000
    assert prefill_work_tokens(1000, 3000, 1e-4) == pytest.approx(1000 * (1 + 1e-4 * 3500))


@pytest.mark.parametrize("num_new_tokens, num_cached_tokens", [(80_000, 0), (60_000, 0), (100_000, 0), WARM])
def test_cold_prompts_and_warm_turns_are_priced_near_the_roofline(num_new_tokens, num_cached_tokens):
    rl = ROOFLINE.prefill_time_s(num_new_tokens, num_cached_tokens)
    assert _shaped().prefill_time_s(num_new_tokens, num_cached_tokens) == pytest.approx(rl, rel=0.15)


def test_one_rate_fitted_at_the_warm_turn_overprices_a_cold_prompt():
    """What the grid's router priced before (``router_cost: "linear-flat"``): the failure above."""
    flat = linear_router_cost(ROOFLINE, *WARM, shaped=False)
    assert flat.attn_coeff == 0.0
    assert flat.prefill_time_s(*WARM) == pytest.approx(ROOFLINE.prefill_time_s(*WARM))
    assert flat.prefill_time_s(80_000, 0) > 1.8 * ROOFLINE.prefill_time_s(80_000, 0)


def _advertised_estimates() -> CostEstimates:
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=ROOFLINE.kv_bytes_per_token), alpha=0.2)
    prior = cost_prior(ROOFLINE, max_num_batched_tokens=8192, max_prefill_chunk_tokens=8192)
    est.advertise("p0", msgspec.to_builtins(prior))
    return est


def test_the_router_takes_the_shape_from_the_workers_cost_prior():
    est = _advertised_estimates()
    assert est.model().attn_coeff == pytest.approx(ROOFLINE.prefill_attn_coeff)
    # a worker that joins with another shape after the scale was measured does not move it
    est.observe_prefill(*WARM, ROOFLINE.prefill_time_s(*WARM))
    before = est.model()
    est.advertise("p1", {"prefill_tokens_per_s": 1.0, "attn_coeff": 1e-3})
    assert est.model().attn_coeff == before.attn_coeff
    assert est.model().prefill_tokens_per_s == before.prefill_tokens_per_s


def test_a_normalised_cold_sample_does_not_move_the_warm_turn_price():
    """Both prefills measured on the same engine sample one scale: after a cold 80 K-token prefill
    the warm turn is still priced as after warm turns only."""
    est = _advertised_estimates()
    for _ in range(30):  # the EWMA settles on the warm turn's scale
        est.observe_prefill(*WARM, ROOFLINE.prefill_time_s(*WARM))
    warm_price = est.model().prefill_time_s(*WARM)
    est.observe_prefill(80_000, 0, ROOFLINE.prefill_time_s(80_000, 0))
    assert est.model().prefill_time_s(*WARM) == pytest.approx(warm_price, rel=0.02)
    assert est.model().prefill_time_s(80_000, 0) == pytest.approx(ROOFLINE.prefill_time_s(80_000, 0), rel=0.15)
    # without the shape the same cold sample moves the warm price by over 15 %
    flat = CostEstimates(LinearCostModel(kv_bytes_per_token=1), alpha=0.2)
    for _ in range(30):
        flat.observe_prefill(*WARM, ROOFLINE.prefill_time_s(*WARM))
    flat_warm = flat.model().prefill_time_s(*WARM)
    flat.observe_prefill(80_000, 0, ROOFLINE.prefill_time_s(80_000, 0))
    assert flat.model().prefill_time_s(*WARM) < 0.85 * flat_warm
