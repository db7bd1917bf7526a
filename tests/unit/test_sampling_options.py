"""vLLM/OpenAI sampling options beyond temperature/top-p: repetition, presence and frequency
penalties, min_p, min_tokens. Oracles: transformers' repetition penalty (same semantics), the
OpenAI penalty definitions on the logits, and path independence (one engine vs prefill +
handoff + decode give the same tokens)."""
from __future__ import annotations

import pytest
import torch

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.executor import TokenHistory
from cpd.engine.sampling import SamplingParams, adjust_logits, sample

BS = 4


@pytest.fixture
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def make_engine(tiny_model_dir):
    engines: list[Engine] = []

    def make() -> Engine:
        e = Engine(tiny_model_dir, num_blocks=64, block_size=BS)
        engines.append(e)
        return e

    yield make
    for e in engines:
        assert not e.has_unfinished() and e.pool.stats()["num_in_use"] == 0
        e.check_invariants()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


def _run(e: Engine, req: EngineRequest) -> list[int]:
    e.add_request(req)
    out: list[int] = []
    while e.has_unfinished():
        for o in e.step():
            out.extend(o.new_token_ids)
    return out


def test_penalties_shift_logits_as_defined():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0], dtype=torch.float64)
    h = TokenHistory(token_ids=[0, 1, 3, 3, 2, 3], prompt_len=2)  # prompt {0, 1}; output 3, 3, 2, 3
    rep = adjust_logits(x, SamplingParams(repetition_penalty=2.0), h)
    assert rep.tolist() == [1.0, -2.0, 0.25, 1.5, -2.0]  # every seen token, prompt included
    pen = adjust_logits(x, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), h)
    assert pen.tolist() == [2.0, -1.0, 0.5 - 0.5 - 0.25, 3.0 - 0.5 - 0.75, -2.0]  # output tokens only
    assert x.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # the input is not changed


def test_banned_ids_never_sampled_and_a_total_ban_stays_safe():
    x = torch.tensor([5.0, 1.0, 0.0])
    h = TokenHistory(banned_ids=frozenset({0}))
    assert sample(x, SamplingParams(), 0, history=h) == 1
    for i in range(50):
        assert sample(x, SamplingParams(temperature=1.0, seed=i), 0, history=h) != 0
    only_banned = torch.tensor([0.0, float("-inf"), float("nan")])
    assert sample(only_banned, SamplingParams(), 0, history=h) in (1, 2)  # allowed tokens, uniform


def test_a_ban_of_every_id_is_not_held_and_never_raises():
    """min_tokens with every id a stop id: no token is allowed, so the ban cannot hold; the
    model's own distribution is kept (greedy: its argmax), never NaN probabilities (it raised
    in torch.multinomial: a 502 for a request the API accepted)."""
    x = torch.tensor([0.5, 3.0, -1.0, 2.0])
    h = TokenHistory(token_ids=[0, 1], prompt_len=2, banned_ids=frozenset(range(4)))
    assert sample(x, SamplingParams(), 0, history=h) == 1
    assert sample(x, SamplingParams(temperature=1e-300, seed=3), 0, history=h) == 1
    for i in range(20):
        tok = sample(x, SamplingParams(temperature=2.0, seed=i, repetition_penalty=1.5), 0, history=h)
        assert 0 <= tok < 4
    assert adjust_logits(x.double(), SamplingParams(), h).tolist() == x.double().tolist()


@pytest.mark.parametrize("penalty", [1e-300, 1e300])
def test_extreme_repetition_penalty_stays_safe(penalty):
    x = torch.tensor([3.0, -2.0, 1.0, -1.0])
    h = TokenHistory(token_ids=[0, 1, 2, 3], prompt_len=4)  # every token seen
    for t in (0.0, 1.0):
        tok = sample(x, SamplingParams(temperature=t, repetition_penalty=penalty, seed=1), 0, history=h)
        assert 0 <= tok < 4
        if penalty < 1:  # positives overflow to +inf: only they stay possible
            assert tok in (0, 2)


def test_min_p_one_is_greedy():
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        x = torch.randn(100, generator=g)
        assert sample(x, SamplingParams(temperature=1.0, min_p=1.0, seed=i), 0) == int(x.argmax())


def test_sampling_values_are_validated():
    for bad in (dict(min_p=1.5), dict(repetition_penalty=0.0), dict(presence_penalty=2.5),
                dict(frequency_penalty=-3.0), dict(min_tokens=20, max_tokens=10), dict(min_tokens=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_repetition_penalty_matches_transformers(model_dir, make_engine):
    from transformers import LlamaForCausalLM
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    p = prompt(3, 11)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=0.5,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
    got = _run(make_engine(), EngineRequest("r", p, SamplingParams(max_tokens=12, repetition_penalty=0.5,
                                                                    ignore_eos=True)))
    assert got == ref  # < 1 favours repeating: the penalty changes this output (next line)
    assert got != _run(make_engine(), EngineRequest("g", p, SamplingParams(max_tokens=12, ignore_eos=True)))


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=10, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4,
                   ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, top_k=40, min_p=0.05, frequency_penalty=1.0, seed=11,
                   ignore_eos=True),
])
def test_penalties_are_path_independent(make_engine, sp):
    p = prompt(21, 14)
    whole = _run(make_engine(), EngineRequest("w", p, sp))
    pf = make_engine()
    first = _run(pf, EngineRequest("h", p, sp, mode="prefill"))
    kv, toks = pf.export_kv("h")
    pf.release("h")
    dec = make_engine()
    dec.add_decode_request("h", toks, kv, sp, num_generated=1)
    rest: list[int] = []
    while dec.has_unfinished():
        for o in dec.step():
            rest.extend(o.new_token_ids)
    assert first + rest == whole and len(whole) == 10


def test_min_tokens_holds_back_stop_ids(make_engine):
    e = make_engine()
    p = prompt(80, 10)
    free_run = _run(e, EngineRequest("f", p, SamplingParams(max_tokens=8, ignore_eos=True)))
    stop_tok = free_run[1]
    early = _run(e, EngineRequest("s", p, SamplingParams(max_tokens=8, stop_token_ids=(stop_tok,), ignore_eos=True)))
    assert early == free_run[:2]
    held = _run(e, EngineRequest("m", p, SamplingParams(max_tokens=8, min_tokens=5, stop_token_ids=(stop_tok,),
                                                         ignore_eos=True)))
    assert stop_tok not in held[:5] and held[0] == free_run[0]
    assert len(held) == 8 or (len(held) > 5 and held[-1] == stop_tok)
