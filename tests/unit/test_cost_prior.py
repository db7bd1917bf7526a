"""The router's start-up cost estimate comes from the workers (issue 11/10).

A modeled worker advertises, in its ``GET /info`` (:class:`cpd.messages.worker_api.CostPrior`),
the prefill rate of a full prefill step and its L2/L3 links, from its cost model stretched by its
time dilation K (:mod:`cpd.costmodel.prior`). The router prices with the advertised figures until
it has measured each one (:meth:`cpd.router.estimates.CostEstimates.advertise`); its configured
default only when no worker says anything. Before this, the live router priced the first prefills
of a modeled 70B/H100 deployment at K = 3 at 2,000 tok/s wall (6,000 modeled) against the
engine's ~3,480 (docs/results/modeled_ordering/README.md, "Session 11 rerun").
"""
from __future__ import annotations

import msgspec
import pytest

from cpd.costmodel.prior import cost_prior, full_step_prefill_chunks
from cpd.engine.engine import Engine
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.engine.scheduler import SchedulerConfig
from cpd.messages.worker_api import WorkerInfoReport, decode_body, encode
from cpd.policy.cost_model import RooflineCostModel
from cpd.policy.routing import LinearCostModel
from cpd.router.dispatch_records import observe_prefill
from cpd.router.estimates import CostEstimates
from cpd.worker.server import engine_cost_prior

SHAPE, GPU, K = "llama-3.1-70b", "h100", 3.0
DEFAULT = LinearCostModel(kv_bytes_per_token=1000)


def _roofline() -> RooflineCostModel:
    from cpd.engine.executor_modeled import resolve_model_shape
    return RooflineCostModel.build(resolve_model_shape(SHAPE), GPU, 1)


def _modeled_engine(budget: int, chunk: int) -> Engine:
    ex = build_modeled_executor(SHAPE, GPU, 1, time_dilation=K)
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_prefill_chunk_tokens=chunk)
    return Engine(None, num_blocks=64, executor=ex, scheduler_config=sc)


def test_full_step_chunks_fill_the_budget():
    assert full_step_prefill_chunks(2048, 2048) == [(2048, 0)]
    assert full_step_prefill_chunks(2048, 512) == [(512, 0)] * 4
    assert full_step_prefill_chunks(1000, 384) == [(384, 0), (384, 0), (232, 0)]


def test_a_modeled_worker_advertises_its_roofline_step_rate_over_k():
    eng = _modeled_engine(2048, 2048)
    prior = engine_cost_prior(eng)
    assert prior is not None
    rl = _roofline()
    # the scale of a full cold step in the architecture's shape: 2048 tokens at mean context 1024
    assert prior.attn_coeff == pytest.approx(rl.model.prefill_attn_coeff)
    work = 2048 * (1 + rl.model.prefill_attn_coeff * 1024)
    assert prior.prefill_tokens_per_s == pytest.approx(work / (rl.step_time_s([(2048, 0)]) * K))
    assert prior.l2_bytes_per_s == pytest.approx(rl.link_bytes_per_s("L2") / K)
    assert prior.l3_bytes_per_s == pytest.approx(rl.link_bytes_per_s("L3") / K)
    assert "K=3" in prior.source
    # a worker without a store does not advertise an L3 link
    assert engine_cost_prior(eng, has_l3=False).l3_bytes_per_s is None
    # the message round-trips through GET /info's type; an old worker's /info (no cost_prior) still decodes
    info = WorkerInfoReport(worker_id="p0", role="prefill", boot_id="b", namespace={}, max_model_len=8,
                            kv_bytes_per_token=1, cost_prior=prior)
    assert decode_body(encode(info), WorkerInfoReport).cost_prior == prior
    old = msgspec.json.encode({k: v for k, v in msgspec.to_builtins(info).items() if k != "cost_prior"})
    assert decode_body(old, WorkerInfoReport).cost_prior is None


def test_an_engine_without_a_cost_model_or_an_architecture_advertises_nothing():
    class _Executor:  # neither a cost_model nor a model_shape
        pass

    class _Engine:
        executor = _Executor()

    assert engine_cost_prior(_Engine()) is None


def test_a_torch_engine_advertises_its_architectures_prefill_shape_alone(tiny_model_dir):
    """A real model's times are measured, not modeled, but its config gives the shape of its prefill
    cost: the router prices a cold long prompt with the attention term from the first request on,
    and normalises its rate samples by it (it priced torch workers with one flat rate before)."""
    from cpd.costmodel.model_shapes import load_config
    eng = Engine(tiny_model_dir, num_blocks=16, block_size=16)
    prior = engine_cost_prior(eng)
    shape = load_config(f"{tiny_model_dir}/config.json")
    assert prior is not None and prior.attn_coeff == pytest.approx(shape.prefill_attn_coeff)
    assert prior.attn_coeff > 0
    assert prior.prefill_tokens_per_s is None and prior.l2_bytes_per_s is None and prior.l3_bytes_per_s is None
    est = CostEstimates(DEFAULT)
    est.advertise("p0", msgspec.to_builtins(prior))
    assert est.model().attn_coeff == pytest.approx(shape.prefill_attn_coeff)
    assert est.model().prefill_tokens_per_s == DEFAULT.prefill_tokens_per_s  # the scale stays the router's


def test_before_any_measurement_the_router_prices_at_the_advertised_rate():
    prior = msgspec.to_builtins(engine_cost_prior(_modeled_engine(2048, 2048)))
    est = CostEstimates(DEFAULT)
    assert est.model().prefill_tokens_per_s == 2000.0  # nobody spoke yet: the configured default
    est.advertise("p0", prior)
    est.advertise("p1", prior)
    m = est.model()
    assert m.prefill_tokens_per_s == pytest.approx(prior["prefill_tokens_per_s"])
    assert m.attn_coeff == pytest.approx(prior["attn_coeff"])  # the architecture's shape
    cold_step_work = 1 + m.attn_coeff * 1024  # a 2048-token cold step's tokens attend to 1024 on average
    assert m.prefill_tokens_per_s * K / cold_step_work == pytest.approx(3480, rel=0.01)  # modeled tok/s of the step
    assert m.l3_bytes_per_s == pytest.approx(prior["l3_bytes_per_s"])
    assert m.l2_bytes_per_s == pytest.approx(prior["l2_bytes_per_s"])
    assert m.kv_bytes_per_token == DEFAULT.kv_bytes_per_token  # not the workers' to say


def test_the_prior_is_the_mean_of_the_advertisers_and_falls_back_to_the_default():
    est = CostEstimates(DEFAULT)
    est.advertise("p0", {"prefill_tokens_per_s": 1000.0, "source": "x"})
    est.advertise("p1", {"prefill_tokens_per_s": 3000.0, "l3_bytes_per_s": None})
    est.advertise("d0", None)  # a torch worker: nothing
    assert est.model().prefill_tokens_per_s == pytest.approx(2000.0)
    assert est.model().l3_bytes_per_s == DEFAULT.l3_bytes_per_s  # nobody advertised L3
    est.forget("p1")
    assert est.model().prefill_tokens_per_s == pytest.approx(1000.0)
    est.advertise("p0", {})  # withdrawn
    assert est.model().prefill_tokens_per_s == DEFAULT.prefill_tokens_per_s


def test_a_measurement_continues_from_the_prior_and_then_owns_the_figure():
    est = CostEstimates(DEFAULT, alpha=0.2)
    est.advertise("p0", {"prefill_tokens_per_s": 1200.0, "l3_bytes_per_s": 14e9})
    # one prefill of 2048 computed tokens in 1.6 s of compute (engine steps of 2048 tokens in 1.6 s)
    observe_prefill(est, {}, 2048, 1.6, step_tokens=2048, step_s=1.6)
    assert est.model().prefill_tokens_per_s == pytest.approx(0.8 * 1200.0 + 0.2 * 1280.0)  # EWMA from the prior
    assert est.measured == {"prefill_tokens_per_s"}
    # a worker joining later moves only what is still unmeasured
    est.advertise("p1", {"prefill_tokens_per_s": 9999.0, "l3_bytes_per_s": 16e9})
    assert est.model().prefill_tokens_per_s == pytest.approx(1216.0)
    assert est.model().l3_bytes_per_s == pytest.approx(15e9)
    est.observe_transfer("L3", 10_000_000, 0.001)
    assert est.model().l3_bytes_per_s == pytest.approx(0.8 * 15e9 + 0.2 * 10e9)
    est.forget("p1")
    assert est.model().l3_bytes_per_s == pytest.approx(0.8 * 15e9 + 0.2 * 10e9)


def test_cost_prior_of_a_calibrated_model_without_an_l3_link():
    class _Calibrated:  # the CalibratedCostModel surface: step_time_s, link_bytes_per_s (KeyError: not measured)
        def step_time_s(self, prefill=(), decode_ctx_tokens=0, num_decode=0):
            return 0.001 + 1e-4 * sum(n for n, _ in prefill)

        def link_bytes_per_s(self, tier):
            if tier == "L2":
                return 8e9
            raise KeyError(tier)

    p = cost_prior(_Calibrated(), time_dilation=2.0, max_num_batched_tokens=512, max_prefill_chunk_tokens=256)
    assert p.prefill_tokens_per_s == pytest.approx(512 / (2.0 * (0.001 + 1e-4 * 512)))
    assert p.l2_bytes_per_s == pytest.approx(4e9) and p.l3_bytes_per_s is None
    with pytest.raises(ValueError):
        cost_prior(_Calibrated(), time_dilation=0, max_num_batched_tokens=512, max_prefill_chunk_tokens=256)
