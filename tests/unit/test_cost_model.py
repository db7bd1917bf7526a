"""Roofline cost model against hand calculations (Llama-3.1-8B config numbers, B200 datasheet)."""
import pytest

from cpd.policy.cost_model import Efficiency, RooflineCostModel
from cpd.policy.routing import CostModel, LoadPlan, PrefixMatch, RoutingConfig, WorkerLoad, route


def test_prefill_time_matches_hand_calculation():
    c = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=1)
    # Llama-3.1-8B: h=4096, I=14336, L=32, 32 heads, 8 kv heads, d=128, V=128256
    per_layer = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    linear = 32 * per_layer + 128256 * 4096
    n = 1000
    flops = 2 * linear * n + 4 * 32 * 32 * 128 * n * (0 + n / 2)
    t_compute = flops / (2.25e15 * 0.5)
    weights = (linear + 128256 * 4096) * 2
    t_mem = (weights + 131072 * n) / (8e12 * 0.8)
    assert c.prefill_time_s(n, 0) == pytest.approx(max(t_compute, t_mem) + 2e-3, rel=1e-9)
    assert c.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_decode_is_memory_bound_and_tp_allreduce():
    c = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=1)
    # 8 sequences, 8000 context tokens: bytes = weights + kv; one token each
    w = c.weight_bytes
    expect = (w + 131072 * 8000) / (8e12 * 0.8) + 1e-3
    assert c.decode_step_time_s(8, 8000) == pytest.approx(expect, rel=1e-9)
    c4 = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=4)
    ar = 2 * 32 * (2 * 3 / 4 * (100 * 4096 * 2) / (1.8e12 * 0.7) + 10e-6)
    assert c4.allreduce_s(100) == pytest.approx(ar, rel=1e-9)


def test_load_time_per_tier():
    c = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=4)
    assert c.load_time_s("L1", 10**9) == 0.0
    assert c.load_time_s("L3", 10**9) == pytest.approx(1e9 / (4 * 50e9 * 0.85) + 2e-3)
    assert c.load_time_s("L2", 10**9) == pytest.approx(1e9 / (4 * 64e9 * 0.8) + 1e-4)
    with pytest.raises(ValueError):
        c.load_time_s("L9", 1)


def test_implements_routing_protocol():
    c: CostModel = RooflineCostModel.build("Qwen3-32B", "H100", tp=2, eff=Efficiency())
    d = route(4096, PrefixMatch(l3=7), [WorkerLoad("p0", "prefill")], RoutingConfig(block_size=512), c)
    assert d.load_plan == LoadPlan(0, 0, 7)
