"""What the router records about each dispatched request: Prometheus metrics
(:class:`cpd.router.metrics.RouterMetrics`), the live cost model's observations
(:class:`cpd.router.estimates.CostEstimates`) and the bounded routing records served at
``GET /cpd/requests``. Everything here reads typed fields of the decision and of the worker's
answer; the decision's ``reasons`` strings are only copied into the records for people."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict
from typing import Any, Mapping

from cpd.messages.worker_api import PrefillAnswer
from cpd.policy.routing import LinearCostModel, RouteDecision
from cpd.router.api_keys import current_tenant
from cpd.router.estimates import CostEstimates
from cpd.router.metrics import RouterMetrics
from cpd.types import Tier

MAX_RECENT_REQUESTS = 1000


def record_prefill(m: RouterMetrics, estimates: CostEstimates, d: RouteDecision, pre: PrefillAnswer,
                   ttft_s: float, num_prompt_tokens: int) -> None:
    """Metrics and cost-model observations of one finished prefill."""
    m.routed.labels(d.request_class, d.pool).inc()
    m.route_decisions.labels(str(d.reason)).inc()
    m.ttft_s.labels(d.request_class, d.pool).observe(ttft_s)
    if pre.queue_s is not None:
        m.queue_time_s.labels(d.pool).observe(pre.queue_s)
    by_tier = pre.num_cached_tokens_by_tier
    loaded = 0
    for tier, n in by_tier.items():
        if n:
            m.prompt_tokens.labels(tier).inc(n)
            m.prefix_hits.labels(tier).inc()
            loaded += n
    computed = max(0, num_prompt_tokens - loaded)
    m.prompt_tokens.labels("computed").inc(computed)
    bytes_per_token = estimates.model().kv_bytes_per_token
    for tier in (Tier.L2, Tier.L3):
        m.kv_bytes.labels(tier).inc(by_tier.get(tier, 0) * bytes_per_token)
    for tier, (nbytes, seconds) in pre.transfers.items():
        estimates.observe_transfer(tier, nbytes, seconds)
    m.kv_bytes.labels("handoff").inc(pre.kv_bytes)
    if d.recompute is not None:
        m.load_decisions.labels(d.recompute.tier).inc()
    for kind, n in pre.fallback.items():
        m.fallbacks.labels(kind).inc(n)
    observe_prefill(estimates, by_tier, num_prompt_tokens, pre.compute_s or pre.prefill_s, pre.step_tokens, pre.step_s)
    publish_cost_model(m, estimates.model())


def publish_cost_model(m: RouterMetrics, cm: LinearCostModel) -> None:
    """The cost model's prefill rate and tier bandwidths as the ``cpd_cost_model_*`` gauges."""
    m.cost_prefill_rate.set(cm.prefill_tokens_per_s)
    m.cost_bandwidth.labels(Tier.L2).set(cm.l2_bytes_per_s)
    m.cost_bandwidth.labels(Tier.L3).set(cm.l3_bytes_per_s)


def observe_prefill(estimates: CostEstimates, by_tier: Mapping[Tier, int], num_prompt_tokens: int,
                    compute_s: float, step_tokens: int | None = None, step_s: float | None = None) -> None:
    """Feed one prefill to the cost estimates (live and simulated router alike): its computed and
    cached tokens, and its compute time less the estimated time of its L2/L3 prefix loads; the
    engine's step figures when the worker reports them (:meth:`CostEstimates.observe_prefill`)."""
    loaded = sum(by_tier.values())
    cm = estimates.model()
    estimates.observe_prefill(max(0, num_prompt_tokens - loaded), loaded, compute_s - _loads_s(cm, by_tier),
                              step_tokens, step_s)


def _loads_s(cm: LinearCostModel, by_tier: Mapping[Tier, int]) -> float:
    """The estimated time of a prefill's L2/L3 prefix loads (the engine runs them inside the
    request's compute time, which the prefill-time fit must not count)."""
    return sum(cm.load_time_s(t, n * cm.kv_bytes_per_token) for t in (Tier.L2, Tier.L3)
               if (n := by_tier.get(t, 0)))


class RecentRequests:
    """The routing records of the last :data:`MAX_RECENT_REQUESTS` requests (``/cpd/requests``),
    each kept with the tenant it was made for (:data:`cpd.router.api_keys.current_tenant` when it
    is recorded): with API keys, a client sees only its own tenant's records
    (:meth:`visible_to`), since they tell prompt lengths and cache hits."""

    def __init__(self, max_requests: int = MAX_RECENT_REQUESTS):
        self.max_requests = max_requests
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._tenant_of: dict[str, str | None] = {}

    def remember(self, request_id: str, d: RouteDecision, pre: PrefillAnswer, num_prompt_tokens: int,
                 ttft_s: float, raw_wait_s: float = 0.0) -> None:
        """Record one routed request: the decision (``reason``: why the winner won; ``candidates``:
        every candidate's estimates, seconds), what the worker reported (cache hits per tier, its
        call / queue / compute seconds, the steps it shared), TTFT and the read-after-write hold
        (``raw_wait_s``)."""
        self.records[request_id] = {
            "class": str(d.request_class), "pool": str(d.pool), "prefill_worker": d.prefill_worker,
            "decode_worker": d.decode_worker, "reuse_ratio": d.reuse_ratio, "reasons": list(d.reasons),
            "reason": str(d.reason), "decode_append": d.decode_append, "write_through": d.write_through,
            "estimated_ttft_s": d.estimated_ttft_s,
            "candidates": [{**asdict(c), "role": str(c.role)} for c in d.candidates],
            "raw_wait_s": raw_wait_s, "load_plan": asdict(d.load_plan),
            "cached_tokens_by_tier": {str(t): n for t, n in pre.num_cached_tokens_by_tier.items()},
            "prompt_tokens": num_prompt_tokens, "ttft_s": ttft_s,
            # the prefill worker's own account (PrefillResponse): its whole call, the engine queue,
            # the rest, and the steps that ran while this request was admitted (all their tokens)
            "worker_prefill_s": pre.prefill_s, "worker_queue_s": pre.queue_s, "worker_compute_s": pre.compute_s,
            "step_tokens": pre.step_tokens, "step_s": pre.step_s}
        self._tenant_of[request_id] = current_tenant.get()
        while len(self.records) > self.max_requests:
            old, _ = self.records.popitem(last=False)
            self._tenant_of.pop(old, None)

    def visible_to(self, tenant: str | None) -> dict[str, dict[str, Any]]:
        """The records ``tenant`` may read: all of them without API keys (``tenant`` None: one
        trusted client population), else only that tenant's."""
        if tenant is None:
            return dict(self.records)
        return {rid: rec for rid, rec in self.records.items() if self._tenant_of.get(rid) == tenant}

    def note_decode_retry(self, request_id: str, decode_worker: str | None, reprefills: int, error: str) -> None:
        rec = self.records.get(request_id)
        if rec is not None:
            rec["decode_worker"] = decode_worker
            rec["reprefills"] = reprefills
            rec.setdefault("decode_failures", []).append(error[:200])

    def get(self, request_id: str) -> dict[str, Any] | None:
        return self.records.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.records

    def __getitem__(self, request_id: str) -> dict[str, Any]:
        return self.records[request_id]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def keys(self):
        return self.records.keys()

    def values(self):
        return self.records.values()

    def items(self):
        return self.records.items()
