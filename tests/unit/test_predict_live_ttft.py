"""benchmarks/predict_live_ttft.py's pure parts: the live-overhead fit, the slice check, and a
prediction on a real trace slice with shared cores and the per-request overhead."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cpd.costmodel.calibrated import CalibratedCostModel

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared/data/traces/mooncake/conversation_trace.jsonl"
PROFILE = ROOT / "cpd/costmodel/profiles/smollm2-135m-amd-t1.json"


@pytest.fixture(scope="module")
def plt():
    spec = importlib.util.spec_from_file_location("predict_live_ttft", ROOT / "benchmarks/predict_live_ttft.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(pairs):
    return [{"predicted_s": x, "wall_s": y} for x, y in pairs]


def test_overhead_fit_recovers_a_line(plt):
    got = plt.fit_live_overhead(_rows([(x, 0.09 + 1.15 * x) for x in (0.2, 0.6, 1.1, 2.1, 4.6, 10.8)]))
    assert got == {"request_s": pytest.approx(0.09, abs=1e-4), "factor": pytest.approx(1.15, abs=1e-4),
                   "num_rows": 6}


def test_overhead_fit_never_gives_a_negative_request_time(plt):
    """A live stack faster than the profile with a negative intercept: the intercept is 0 and
    the factor is refitted through the origin."""
    got = plt.fit_live_overhead(_rows([(1.0, 0.7), (2.0, 1.6), (10.0, 9.0)]))
    assert got["request_s"] == 0.0
    assert got["factor"] == pytest.approx((0.7 + 3.2 + 90.0) / 105.0, abs=1e-4)


def test_measured_from_must_replay_the_same_slice(plt):
    plt.check_same_slice({"trace": "/a", "requests": 60}, {"trace": "/b", "requests": 60})  # the path may move
    with pytest.raises(SystemExit, match="requests"):
        plt.check_same_slice({"trace": "/a", "requests": 60}, {"trace": "/a", "requests": 120})


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not beside the checkout")
def test_overhead_and_shared_cores_only_lengthen_the_prediction(plt):
    a = plt.build_parser().parse_args(["--profile", str(PROFILE), "--trace", str(TRACE), "--requests", "30",
                                       "--time-scale", "0.1", "--spread-ticks", "--out", "unused.json"])
    cost = CalibratedCostModel.load(PROFILE)
    plain = plt.predict(cost, "cpd:1:1:1", a)
    a.cores = 1
    one_core = plt.predict(cost, "cpd:1:1:1", a)
    with_overhead = plt.predict(cost, "cpd:1:1:1", a, request_overhead_s=0.1)
    assert plain["completed"] == one_core["completed"] == with_overhead["completed"] == 30
    assert one_core["ttft_s"]["mean"] > plain["ttft_s"]["mean"]
    assert with_overhead["ttft_s"]["mean"] > plain["ttft_s"]["mean"]
    assert sum(with_overhead["busy_s"].values()) > sum(plain["busy_s"].values())
