"""The live router prices its first prefills at the rate the workers advertise (real router, real
modeled worker processes, real HTTP, an L3 file store; ``pd`` 2 + 1; issue 11/10).

Before, the router started from its ``LinearCostModel`` default (2,000 prompt tokens/s of wall
time, L3 1 GB/s) until the first prefills came back, while the simulator priced them with the
roofline from t = 0 (docs/results/modeled_ordering/README.md, "Session 11 rerun"). Now each
worker's ``GET /info`` carries its ``cost_prior`` (the modeled executor's roofline × K) and the
router uses it until it has measured the figure. Since session 18 the prior carries the shape of
prefill cost too (``attn_coeff``, the architecture's) and the rate is the scale in that shape.
"""
from __future__ import annotations

import httpx
import pytest

from cpd.engine.executor_modeled import resolve_model_shape
from cpd.policy.cost_model import RooflineCostModel
from deploy_util import complete, random_prompt, routing_record, start

SHAPE, GPU, K, BUDGET = "llama-3.1-70b", "h100", 3.0, 2048
MODELED = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
           "engine.time_dilation": K, "engine.max_num_batched_tokens": BUDGET,
           "engine.max_prefill_chunk_tokens": BUDGET, "engine.block_size": 64, "engine.num_blocks": 256,
           "handoff.arena_bytes": 16 << 20}


def _gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("cpd_cost_model_prefill_tokens_per_second"):
            out["prefill_tokens_per_s"] = float(line.split()[-1])
        elif line.startswith("cpd_cost_model_bandwidth_bytes_per_second"):
            out["l3_bytes_per_s" if 'tier="L3"' in line else "l2_bytes_per_s"] = float(line.split()[-1])
    return out


def test_the_router_prices_its_first_prefills_at_the_workers_advertised_rate(tiny_model_dir, tmp_path):
    rl = RooflineCostModel.build(resolve_model_shape(SHAPE), GPU, 1)
    attn = rl.model.prefill_attn_coeff  # the architecture's shape of prefill cost
    # the scale of a full cold prefill step of the roofline (its tokens attend to BUDGET/2 on average), wall-clock
    rate = BUDGET * (1 + attn * BUDGET / 2) / (rl.step_time_s([(BUDGET, 0)]) * K)
    dep = start(tiny_model_dir, "pd", kv_store=f"file://{tmp_path / 'l3'}", num_prefill=2, num_decode=1,
                settings=MODELED)
    try:
        workers = httpx.get(f"{dep.url}/cpd/workers", timeout=10).json()
        priors = {wid: w["cost_prior"] for wid, w in workers.items()}
        assert all(p is not None for p in priors.values()), priors
        for wid, p in priors.items():
            assert p["prefill_tokens_per_s"] == pytest.approx(rate), wid
            assert p["attn_coeff"] == pytest.approx(attn), wid
            assert p["l2_bytes_per_s"] == pytest.approx(rl.link_bytes_per_s("L2") / K), wid
        assert {wid: "l3_bytes_per_s" in p for wid, p in priors.items()} == \
            {wid: w["role"] != "decode" for wid, w in workers.items()}  # only workers with a store have L3
        g = _gauges(dep.url)  # before any request: the advertised figures, not the 2,000 tok/s default
        assert g["prefill_tokens_per_s"] == pytest.approx(rate)
        assert g["l3_bytes_per_s"] == pytest.approx(rl.link_bytes_per_s("L3") / K)
        assert g["l2_bytes_per_s"] == pytest.approx(rl.link_bytes_per_s("L2") / K)
        # the first request's estimate is priced with it: its own prefill at the advertised rate
        prompt = random_prompt(3, 1024)
        rec = routing_record(dep, complete(dep, prompt, max_tokens=2)["id"])
        work = len(prompt) * (1 + attn * len(prompt) / 2)
        assert rec["estimated_ttft_s"] == pytest.approx(work / rate, rel=0.05), rec
        # after it the scale is measured: an EWMA step from the prior towards the engine's rate in the shape
        after = _gauges(dep.url)["prefill_tokens_per_s"]
        sample = rec["step_tokens"] / rec["step_s"] * (1 + attn * len(prompt) / 2)
        assert after == pytest.approx(0.8 * rate + 0.2 * sample, rel=1e-6), (after, rate, sample)
    finally:
        dep.stop()
