"""CalibratedCostModel: the shipped profiles reproduce their own points within the stated fit
error, the fitter recovers known coefficients, malformed profiles are refused by name, and the
modeled executor / engine simulator run on it."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from cpd.costmodel.calibrated import (FORMAT, CalibratedCostModel, ProfileError, decode_features, fit_linear,
                                      fit_profile, prefill_step_features)
from cpd.engine.executor import ForwardSeq
from cpd.engine.executor_modeled import ModeledExecutor, ModeledModelConfig
from cpd.engine.scheduler import SchedulerConfig
from cpd.policy.routing import LinearCostModel, RoutingConfig
from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator
from cpd.sim.workload import SimRequest
from cpd.types import Topology

PROFILES = sorted((Path(__file__).resolve().parents[2] / "cpd/costmodel/profiles").glob("*.json"))


def _synthetic_doc() -> dict:
    """A small profile whose points follow known coefficients exactly."""
    pc, dc = (0.05, 5e-4, 2e-7, 3e-5), (0.06, 2e-3, 3e-6)
    pts = [{"kind": "prefill", "n": n, "p": p,
            "t_s": sum(c * f for c, f in zip(pc, prefill_step_features(n, p)))}
           for n in (16, 128, 512, 2048) for p in (0, 1024, 4096)]
    pts += [{"kind": "decode", "b": b, "c": c, "t_s": sum(k * f for k, f in zip(dc, decode_features(b, b * c)))}
            for b in (1, 4, 16) for c in (128, 1024)]
    model = {"name": "tiny", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "head_dim": 16, "vocab_size": 1000, "max_context": 8192, "kv_dtype_bytes": 2}
    return {"format": FORMAT, "model": model, "machine": {"host": "h", "dtype": "bfloat16", "threads": 1},
            **fit_profile(pts), "transfer": {"L2": {"bytes_per_s": 4e9, "latency_s": 1e-4},
                                             "L3": {"bytes_per_s": 1e9, "latency_s": 1e-3},
                                             "NIC": {"bytes_per_s": 2e9, "latency_s": 0.0}},
            "points": pts}


def test_fit_recovers_known_coefficients():
    doc = _synthetic_doc()
    assert doc["prefill"]["coef"] == pytest.approx({"a_s": 0.05, "b_s_per_token": 5e-4, "c_s_per_token_ctx": 2e-7,
                                                    "g_s_per_cached_token": 3e-5}, rel=1e-6)
    assert doc["decode"]["coef"] == pytest.approx({"d_s": 0.06, "e_s_per_seq": 2e-3, "f_s_per_ctx_token": 3e-6},
                                                  rel=1e-6)
    assert doc["prefill"]["fit"]["r2"] == pytest.approx(1.0)
    assert doc["prefill"]["fit"]["max_rel_error"] < 1e-9


def test_fit_pins_negative_coefficients_to_zero():
    # y falls with x: the slope would be negative; it is pinned to 0 and the constant refitted
    coef, st = fit_linear([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0])
    assert coef[1] == 0.0 and coef[0] > 0
    assert st["max_rel_error"] > 0


def test_fit_refuses_too_few_points_and_bad_times():
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_linear([[1.0, 2.0, 3.0]], [1.0])
    with pytest.raises(ValueError, match="> 0"):
        fit_linear([[1.0, 1.0], [1.0, 2.0]], [1.0, 0.0])


@pytest.mark.parametrize("path", PROFILES, ids=[p.name for p in PROFILES])
def test_shipped_profile_reproduces_its_points(path):
    cm = CalibratedCostModel.load(path)
    doc = json.loads(path.read_text())
    assert doc["points"], "a profile carries its raw points"
    for kind in ("prefill", "decode"):
        stated = doc[kind]["fit"]["max_rel_error"]
        for q in (q for q in doc["points"] if q["kind"] == kind):
            t = cm.prefill_time_s(q["n"], q["p"]) if kind == "prefill" else cm.decode_step_time_s(q["b"], q["b"] * q["c"])
            assert abs(t - q["t_s"]) / q["t_s"] <= stated + 1e-9, (kind, q)
    m = doc["machine"]
    assert m["threads"] >= 1 and m["dtype"] and m["torch"] and m["cpu"]


def test_model_interface():
    cm = CalibratedCostModel.from_dict(_synthetic_doc())
    assert cm.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert cm.prefill_time_s(0, 100) == 0.0 and cm.step_time_s() == 0.0
    assert cm.prefill_time_s(100, 1000) == pytest.approx(0.05 + 5e-4 * 100 + 2e-7 * 100 * 1050 + 3e-5 * 1000)
    old = _synthetic_doc()  # a profile from before the cached-token term reads it as 0
    del old["prefill"]["coef"]["g_s_per_cached_token"]
    assert CalibratedCostModel.from_dict(old).prefill_time_s(100, 1000) == pytest.approx(0.121)
    assert cm.decode_step_time_s(4, 400) == pytest.approx(0.06 + 2e-3 * 4 + 3e-6 * 400)
    # a mixed step pays one fixed overhead (the prefill one) plus both variable parts
    mixed = cm.step_time_s(((100, 1000),), decode_ctx_tokens=400, num_decode=4)
    assert mixed == pytest.approx(cm.prefill_time_s(100, 1000) + 2e-3 * 4 + 3e-6 * 400)
    assert cm.load_time_s("L1", 10 ** 9) == 0.0
    assert cm.load_time_s("L3", 10 ** 9) == pytest.approx(1.0 + 1e-3)
    assert cm.transfer_time_s("L2", 4e9) == pytest.approx(1.0 + 1e-4)
    doc = _synthetic_doc()
    del doc["transfer"]["L3"]
    with pytest.raises(KeyError, match="L3"):
        CalibratedCostModel.from_dict(doc).transfer_time_s("L3", 1)


def test_scaled_multiplies_every_time():
    cm = CalibratedCostModel.from_dict(_synthetic_doc())
    s = cm.scaled(2.5)
    assert s.prefill_time_s(300, 700) == pytest.approx(2.5 * cm.prefill_time_s(300, 700))
    assert s.step_time_s(((64, 0),), 900, 3) == pytest.approx(2.5 * cm.step_time_s(((64, 0),), 900, 3))
    assert s.transfer_time_s("L3", 1e9) == pytest.approx(2.5 * cm.transfer_time_s("L3", 1e9))
    with pytest.raises(ValueError):
        cm.scaled(0)


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.update(format="other/1"), "format must be"),
    (lambda d: d["prefill"]["coef"].pop("b_s_per_token"), "prefill.coef.b_s_per_token"),
    (lambda d: d["decode"]["coef"].update(f_s_per_ctx_token="fast"), "decode.coef.f_s_per_ctx_token"),
    (lambda d: d["decode"]["coef"].update(d_s=-1.0), "decode.coef.d_s"),
    (lambda d: d["model"].pop("num_layers"), "model.num_layers"),
    (lambda d: d["model"].update(head_dim=1.5), "model.head_dim"),
    (lambda d: d["transfer"].update(L9={"bytes_per_s": 1.0, "latency_s": 0.0}), "unknown tier"),
    (lambda d: d["transfer"]["L2"].update(bytes_per_s=0), "transfer.L2.bytes_per_s"),
    (lambda d: d.pop("decode"), "missing decode"),
])
def test_malformed_profile_is_refused_by_name(tmp_path, mutate, msg):
    doc = copy.deepcopy(_synthetic_doc())
    mutate(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=msg) as ei:
        CalibratedCostModel.load(p)
    assert str(p) in str(ei.value)


def test_not_json_is_refused(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        CalibratedCostModel.load(p)


class _Clock:
    def __init__(self):
        self.waits = []

    def wait(self, s):
        self.waits.append(s)


def test_modeled_executor_waits_the_calibrated_step_time():
    cm = CalibratedCostModel.from_dict(_synthetic_doc())
    clock = _Clock()
    ex = ModeledExecutor(cm, ModeledModelConfig(vocab_size=1000, max_position_embeddings=8192), clock=clock)
    seqs = [ForwardSeq(num_computed=64, num_new=32, blocks=list(range(6)), token_ids=list(range(96)), prompt_len=96),
            ForwardSeq(num_computed=200, num_new=1, blocks=list(range(13)), token_ids=list(range(201)),
                       prompt_len=150)]
    ex.forward(seqs, None, [0, 1])
    assert clock.waits == [pytest.approx(cm.step_time_s(((32, 64),), decode_ctx_tokens=200, num_decode=1))]
    ex.transfer("L3", 100)
    assert clock.waits[-1] == pytest.approx(cm.transfer_time_s("L3", 100 * cm.kv_bytes_per_token))


def test_engine_simulator_runs_on_the_calibrated_model():
    cm = CalibratedCostModel.from_dict(_synthetic_doc())
    sched = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_prefill_chunk_tokens=512, block_size=16)
    insts = (EngineInstanceSpec("prefill", cm, sched, 256, 1 << 20), EngineInstanceSpec("decode", cm, sched, 256))
    cluster = EngineClusterSpec(insts, RoutingConfig(topology=Topology.PD, block_size=16),
                                LinearCostModel(kv_bytes_per_token=cm.kv_bytes_per_token), 16)
    # one request alone: its TTFT is exactly one prefill step of 320 tokens (chunk 512)
    reqs = [SimRequest(0.0, 320, 3, tuple(range(20))), SimRequest(10.0, 320, 3, tuple(range(20)))]
    sim = EngineSimulator(cluster, reqs).run()
    r0, r1 = sim.rec
    assert r0["ttft_t"] - r0["arrival"] == pytest.approx(cm.prefill_time_s(320, 0))
    # the second request hits the first one's 19 full blocks in L1 and computes the last block
    assert r1["ttft_t"] - r1["arrival"] == pytest.approx(cm.prefill_time_s(16, 304))
    assert r0["done_t"] > r0["ttft_t"]
