"""What the router records per request (cpd.router.dispatch_records) comes from typed fields:
the decision's recompute outcome, the worker's per-tier counts, fallbacks and transfers."""
from __future__ import annotations

import re

from cpd.messages.worker_api import PrefillResponse
from cpd.policy.routing import LinearCostModel, LoadPlan, Recompute, RouteDecision
from cpd.router.dispatch_records import RecentRequests, record_prefill
from cpd.router.estimates import CostEstimates
from cpd.router.metrics import RouterMetrics
from cpd.types import RequestClass, Role, Tier


def _metric(text: str, name: str, labels: str) -> float:
    m = re.search(re.escape(f"{name}{{{labels}}}") + r" ([0-9.e+]+)", text)
    return float(m.group(1)) if m else 0.0


def _decision(recompute: Recompute | None) -> RouteDecision:
    return RouteDecision(RequestClass.WARM, Role.PREFILL, "p0", "d0", LoadPlan(2, 0, 0), 0.5, 0.01,
                         recompute=recompute)


def test_metrics_from_typed_fields():
    m, est = RouterMetrics(), CostEstimates(LinearCostModel(kv_bytes_per_token=100))
    ans = PrefillResponse(first_token_ids=[1], finish_reason=None, prefill_s=0.2, queue_s=0.05, compute_s=0.15,
                          num_cached_tokens_by_tier={Tier.L1: 32, Tier.L2: 0, Tier.L3: 16}, kv_bytes=4096,
                          fallback={"store_timeout": 2}, transfers={Tier.L3: (1600, 0.001)})
    record_prefill(m, est, _decision(Recompute(Tier.L3, 3)), ans, ttft_s=0.3, num_prompt_tokens=70)
    record_prefill(m, est, _decision(None), ans, ttft_s=0.3, num_prompt_tokens=70)
    text = m.render().decode()
    assert _metric(text, "cpd_load_vs_recompute_total", 'tier="L3"') == 1.0  # one decision recomputed L3
    assert _metric(text, "cpd_prompt_tokens_total", 'source="L1"') == 64.0
    assert _metric(text, "cpd_prompt_tokens_total", 'source="computed"') == 2 * (70 - 48)
    assert _metric(text, "cpd_kv_bytes_total", 'tier="L3"') == 2 * 16 * 100
    assert _metric(text, "cpd_fallbacks_total", 'kind="store_timeout"') == 4.0
    assert _metric(text, "cpd_routed_total", 'cls="warm",pool="prefill"') == 2.0


def test_recent_records_are_plain_json_and_bounded():
    recent = RecentRequests(max_requests=3)
    ans = PrefillResponse(first_token_ids=[1], finish_reason="stop", prefill_s=0.1,
                          num_cached_tokens_by_tier={Tier.L1: 16})
    for i in range(5):
        recent.remember(f"r{i}", _decision(Recompute(Tier.L2, 1)), ans, 40, 0.1)
    assert list(recent) == ["r2", "r3", "r4"]
    rec = dict(recent)["r4"]
    assert rec["class"] == "warm" and type(rec["class"]) is str and rec["pool"] == "prefill"
    assert rec["reasons"] == ["warm:reuse=0.50", "recompute-L2:1blk"]
    assert rec["cached_tokens_by_tier"] == {"L1": 16} and rec["load_plan"] == {"l1_blocks": 2, "l2_blocks": 0,
                                                                                "l3_blocks": 0}
    recent.note_decode_retry("r4", "d1", 1, "boom")
    assert recent["r4"]["decode_worker"] == "d1" and recent["r4"]["decode_failures"] == ["boom"]
