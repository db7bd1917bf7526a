"""Issue 7 §2(a): the sampler is numerically safe for every value the API accepts.

The example that failed: ``temperature: 1e-300`` made ``logits / T`` overflow to inf, the
softmax NaN and ``torch.multinomial`` raise inside an engine step. The class: any accepted
sampling value (temperature in [0, 2], top_p in (0, 1], any int64 / uint64 seed or None,
top_k ≥ 0) and any logits the model can produce (huge, tiny, ±inf, NaN) must give a valid
token id without raising; values the API cannot accept are refused by ``SamplingParams``
when the request arrives, never inside a step.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpd.engine.sampling import SamplingParams, greedy_tokens, sample

VOCAB = 97

temperatures = st.one_of(
    st.just(0.0), st.sampled_from([5e-324, 1e-300, 1e-30, 1e-8, 1e-3, 2.0]),
    st.floats(min_value=0.0, max_value=2.0, allow_nan=False, allow_infinity=False))
top_ps = st.one_of(st.sampled_from([5e-324, 1e-300, 1e-9, 0.5, 1.0 - 1e-16, 1.0]),
                   st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False))
seeds = st.one_of(st.none(), st.sampled_from([0, -1, -(2 ** 63), 2 ** 63 - 1, 2 ** 64 - 1]),
                  st.integers(min_value=-(2 ** 63), max_value=2 ** 64 - 1))
top_ks = st.one_of(st.sampled_from([0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 10 ** 9]), st.integers(0, 2 * VOCAB))
special = st.sampled_from([float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 1e-45, 0.0])
logit_values = st.one_of(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), special)


@st.composite
def logits(draw):
    kind = draw(st.sampled_from(["normal", "wild", "all_nan", "all_neg_inf", "constant"]))
    if kind == "normal":
        return torch.randn(VOCAB, generator=torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31)))) * \
            draw(st.sampled_from([1e-6, 1.0, 30.0, 1e4]))
    if kind == "wild":
        vals = draw(st.lists(logit_values, min_size=VOCAB, max_size=VOCAB))
        return torch.tensor(vals, dtype=torch.float32)
    if kind == "all_nan":
        return torch.full((VOCAB,), float("nan"))
    if kind == "all_neg_inf":
        return torch.full((VOCAB,), float("-inf"))
    return torch.full((VOCAB,), draw(st.sampled_from([0.0, 1e30, -1e30])))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=logits(), temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=seeds,
       output_index=st.integers(0, 10 ** 6), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_sample_always_returns_a_valid_token(x, temperature, top_p, top_k, seed, output_index, dtype):
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    tok = sample(x.to(dtype), params, output_index, torch.Generator().manual_seed(0))
    assert isinstance(tok, int) and 0 <= tok < VOCAB
    if seed is not None:  # reproducible on any path
        assert sample(x.to(dtype), params, output_index) == tok


@settings(max_examples=200, deadline=None)
@given(x=logits(), top_p=top_ps, top_k=top_ks, seed=seeds)
def test_tiny_temperature_picks_a_most_likely_token(x, top_p, top_k, seed):
    """As T → 0 the draw concentrates on the maximum: 1e-300 must behave like greedy
    (a token of maximal logit), not blow up."""
    clean = x.double().masked_fill(torch.isnan(x), float("-inf"))
    tok = sample(x, SamplingParams(temperature=1e-300, top_p=top_p, top_k=top_k, seed=seed), 0)
    if bool(torch.isfinite(clean).any()) or bool(torch.isposinf(clean).any()):
        assert clean[tok] == clean.max()


def test_possible_tokens_respected():
    x = torch.full((VOCAB,), float("-inf"))
    x[[3, 50]] = torch.tensor([0.0, 0.5])
    x[7] = float("nan")
    seen = {sample(x, SamplingParams(temperature=2.0, seed=s), 0) for s in range(200)}
    assert seen == {3, 50}  # never a -inf or NaN token
    y = torch.zeros(VOCAB)
    y[[11, 12]] = float("inf")
    assert {sample(y, SamplingParams(temperature=1.0, seed=s), 0) for s in range(100)} == {11, 12}


def test_greedy_is_the_same_token_batched_and_alone():
    x = torch.randn(4, VOCAB)
    x[1, 5] = float("nan")  # a NaN must not win the argmax
    x[2] = float("nan")
    batched = greedy_tokens(x)
    alone = [sample(row, SamplingParams(), 0) for row in x]
    assert batched == alone
    assert batched[1] != 5 and 0 <= batched[2] < VOCAB


@pytest.mark.parametrize("kwargs", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": -1e-300},
    {"temperature": "0.5"}, {"temperature": True}, {"top_p": 0.0}, {"top_p": float("nan")},
    {"top_p": 1.0000001}, {"top_k": 1.5}, {"top_k": -1}, {"top_k": True}, {"seed": "7"}, {"seed": 1.0},
    {"max_tokens": 0}, {"max_tokens": 2.5}, {"stop_token_ids": ["a"]},
])
def test_bad_values_are_refused_up_front(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_numeric_types_are_normalised():
    import numpy as np
    p = SamplingParams(temperature=1, top_p=np.float32(0.5), top_k=np.int64(3), seed=np.int64(-5),
                       stop_token_ids=[np.int32(2)])
    assert (type(p.temperature), type(p.top_p), type(p.top_k), type(p.seed)) == (float, float, int, int)
    assert p.stop_token_ids == (2,) and math.isclose(p.top_p, 0.5)
