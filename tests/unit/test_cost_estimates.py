"""The live router's cost estimates (cpd.router.estimates): by default one EWMA rate; with
``fit_prefill`` the prefill terms are fitted to what workers report, so short and long-context
prefills are both priced right; the window is bounded and follows drift; degenerate or noisy
observations fall back to the rate's EWMA."""
from __future__ import annotations

import random

import pytest

from cpd.messages.worker_api import PrefillResponse
from cpd.policy.routing import LinearCostModel, LoadPlan, RouteDecision
from cpd.router.dispatch_records import record_prefill
from cpd.router.estimates import MAX_PREFILL_OBSERVATIONS, MIN_FIT_OBSERVATIONS, CostEstimates
from cpd.router.metrics import RouterMetrics
from cpd.types import RequestClass, Role, Tier

A, B, C = 0.004, 2e-5, 1e-9  # 4 ms per prefill, 50 K tok/s, an attention term that dominates at 100 K


def _t(n: int, p: int, a: float = A, b: float = B, c: float = C) -> float:
    return a + b * n + c * n * (p + n / 2)


def _shapes(rng: random.Random, k: int) -> list[tuple[int, int]]:
    return [(rng.choice([64, 300, 2000, 8000]), rng.choice([0, 4000, 30000, 100000])) for _ in range(k)]


def test_fit_prices_short_cold_and_long_warm_prefills_alike():
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=2000.0), fit_prefill=True)
    for n, p in _shapes(random.Random(1), 64):
        est.observe_prefill(n, p, _t(n, p))
    m = est.model()
    assert est.fit_rms_rel_error is not None and est.fit_rms_rel_error < 1e-6
    for n, p in ((300, 0), (2000, 100000), (128, 0), (16000, 50000)):
        assert m.prefill_time_s(n, p) == pytest.approx(_t(n, p), rel=1e-6)
    # a single rate (what the router had before) is off by > 2x on one of the two shapes
    rate = 2000 / _t(2000, 100000)
    assert 300 / rate > 2 * _t(300, 0)


def test_noisy_observations_still_fit_within_the_noise():
    rng = random.Random(2)
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1000), fit_prefill=True)
    for n, p in _shapes(rng, 200):
        est.observe_prefill(n, p, _t(n, p) * rng.uniform(0.9, 1.1))
    m = est.model()
    for n, p in ((300, 0), (2000, 100000), (8000, 30000)):
        assert m.prefill_time_s(n, p) == pytest.approx(_t(n, p), rel=0.1)


def test_one_shape_only_is_not_separable_and_the_rate_follows_the_ewma():
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=2000.0), alpha=0.5,
                        fit_prefill=True)
    for _ in range(3 * MIN_FIT_OBSERVATIONS):
        est.observe_prefill(1000, 0, 0.1)  # 10 K tok/s, always the same shape
    m = est.model()
    assert est.fit_rms_rel_error is None
    assert m.prefill_tokens_per_s == pytest.approx(10000.0, rel=1e-6)
    assert m.prefill_overhead_s == 0.0 and m.attn_coeff == 0.0


def test_unfittable_noise_is_rejected():
    rng = random.Random(3)
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=2000.0), fit_prefill=True)
    for n, p in _shapes(rng, 100):
        est.observe_prefill(n, p, rng.uniform(0.001, 5.0))  # unrelated to the shape
    assert est.fit_rms_rel_error is None


def test_window_is_bounded_and_follows_a_change_of_speed():
    rng = random.Random(4)
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1000), fit_prefill=True)
    for n, p in _shapes(rng, 500):
        est.observe_prefill(n, p, _t(n, p))
    for n, p in _shapes(rng, MAX_PREFILL_OBSERVATIONS + 8):  # the workers became 3x slower
        est.observe_prefill(n, p, 3 * _t(n, p))
    assert len(est._prefills) == MAX_PREFILL_OBSERVATIONS
    assert est.model().prefill_time_s(2000, 100000) == pytest.approx(3 * _t(2000, 100000), rel=1e-6)


def test_tiny_or_non_positive_observations_are_ignored():
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=2000.0), fit_prefill=True)
    est.observe_prefill(8, 0, 0.5)
    est.observe_prefill(1000, 0, 0.0)
    est.observe_prefill(1000, 0, -1.0)
    assert est.model().prefill_tokens_per_s == 2000.0 and not est._prefills


def test_the_router_fits_compute_without_the_prefix_loads():
    """record_prefill subtracts the estimated L2/L3 load time from the worker's compute time."""
    cost = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=1e9, l3_bytes_per_s=1e9, l3_overhead_s=0.0)
    est, m = CostEstimates(cost, fit_prefill=True), RouterMetrics()
    d = RouteDecision(RequestClass.WARM, Role.PREFILL, "p0", "d0", LoadPlan(0, 0, 10), 0.5, 0.01)
    for n, p in _shapes(random.Random(5), 64):
        load_s = p * 1000 / 1e9  # p tokens of 1000 bytes from L3 at 1 GB/s
        pre = PrefillResponse(first_token_ids=[1], finish_reason=None, prefill_s=_t(n, p) + load_s, queue_s=0.0,
                              compute_s=_t(n, p) + load_s, num_cached_tokens_by_tier={Tier.L3: p}, kv_bytes=0)
        record_prefill(m, est, d, pre, ttft_s=1.0, num_prompt_tokens=n + p)
    assert est.model().prefill_time_s(2000, 100000) == pytest.approx(_t(2000, 100000), rel=1e-6)


def test_by_default_one_ewma_rate_and_no_fit():
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=2000.0))
    for n, p in _shapes(random.Random(6), 64):
        est.observe_prefill(n, p, _t(n, p))
    m = est.model()
    assert est.fit_rms_rel_error is None and m.prefill_overhead_s == 0.0 and m.attn_coeff == 0.0
    assert m.prefill_tokens_per_s != 2000.0


def test_a_batched_burst_of_small_prefills_does_not_bias_the_rate():
    """Ten 24-token prefills batched into one 0.05 s step: each request's own time is the whole
    step's, so its own rate (24 / 0.05 = 480 tok/s) is a tenth of the engine's (4,800 tok/s).
    With the worker's step figures (all ten requests' tokens over the step) the EWMA follows the
    engine's rate; without them (the old per-request sample) it would sink toward 480."""
    cost = LinearCostModel(kv_bytes_per_token=1000, prefill_tokens_per_s=4800.0)
    est, old, m = CostEstimates(cost), CostEstimates(cost), RouterMetrics()
    d = RouteDecision(RequestClass.COLD, Role.PRE_PREFILL, "pp0", "d0", LoadPlan(0, 0, 0), 0.05, 0.05)
    for _ in range(10):
        pre = PrefillResponse(first_token_ids=[1], finish_reason=None, prefill_s=0.05, queue_s=0.0, compute_s=0.05,
                              kv_bytes=0, step_tokens=240, step_s=0.05)
        record_prefill(m, est, d, pre, ttft_s=0.05, num_prompt_tokens=24)
        old.observe_prefill(24, 0, 0.05)
    assert est.model().prefill_tokens_per_s == pytest.approx(4800.0)
    assert old.model().prefill_tokens_per_s < 0.6 * 4800.0  # the bias the step figures remove


def test_step_figures_that_cannot_hold_the_request_fall_back_to_its_own_rate():
    from cpd.router.estimates import prefill_rate_sample
    assert prefill_rate_sample(100, 0.5, 240, 0.1) == pytest.approx(2400.0)
    assert prefill_rate_sample(100, 0.5, 50, 0.1) == pytest.approx(200.0)  # fewer step tokens than its own
    assert prefill_rate_sample(100, 0.5, None, None) == pytest.approx(200.0)  # an append's answer
    assert prefill_rate_sample(100, 0.5, 240, 0.0) == pytest.approx(200.0)
