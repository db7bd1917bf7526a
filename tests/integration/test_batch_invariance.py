"""Batch-invariant mode (``engine.batch_invariant``, :mod:`cpd.engine.batch_invariant`): a row's
result depends on its own inputs only. Checked where the ordinary kernels are not invariant: in
bfloat16 (any CPU computes it; on this machine's AVX512-BF16/AMX kernels about one chunking in five
flipped a greedy token of a 700-token prompt), with the prompt's KV compared bit for bit.

- the prompt's KV is identical whatever the prefill chunks (a step's budget shared with other
  requests gives any chunk size) and whatever else runs in the same steps;
- KV computed by decode steps equals KV a prefill computes for the same tokens (the decode-local
  append and a migrated decode re-prefill generated tokens);
- requests decoded in one batch get the tokens each gets alone.
"""
from __future__ import annotations

import sys

import pytest
import torch

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from deploy_util import random_prompt

GREEDY = dict(temperature=0.0, ignore_eos=True)
DTYPE = torch.bfloat16


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"], autouse=True)
def _dtype(request, monkeypatch):
    """Every test in both dtypes (the mode's claim holds in any dtype; bf16 is where it matters)."""
    monkeypatch.setattr(sys.modules[__name__], "DTYPE", request.param)
    return request.param


def _engine(model_dir, chunk: int = 512, budget: int = 512, num_blocks: int = 128) -> Engine:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_prefill_chunk_tokens=chunk)
    return Engine(model_dir, num_blocks=num_blocks, dtype=DTYPE, scheduler_config=cfg, batch_invariant=True)


def _run(engine: Engine, prompts: dict[str, list[int]], max_tokens: int, mode: str = "full") -> dict[str, list[int]]:
    """Run ``prompts`` together in ``engine``; their output tokens."""
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=max_tokens, **GREEDY), mode=mode))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def _prompt_kv(engine: Engine, prompts: dict[str, list[int]], rid: str) -> tuple[torch.Tensor, list[int]]:
    """Prefill ``prompts`` together (prefill mode); ``rid``'s exported KV and tokens. Every held
    request is released."""
    _run(engine, prompts, 2, mode="prefill")  # finishes with "handoff" after its first token
    kv, toks = engine.export_kv(rid)
    kv = kv.clone()
    for r in prompts:
        engine.release(r)
    engine.step()
    return kv, toks


def test_prompt_kv_is_bit_identical_whatever_the_chunks_and_the_batch(tiny_model_dir):
    prompt = random_prompt(703, 300)
    ref_kv, ref_toks = _prompt_kv(_engine(tiny_model_dir), {"a": prompt}, "a")
    others = {f"o{i}": random_prompt(900 + i, 150 + 37 * i) for i in range(3)}
    cases = {"chunk 1": (_engine(tiny_model_dir, chunk=1), {"a": prompt}),
             "chunk 7": (_engine(tiny_model_dir, chunk=7), {"a": prompt}),
             "chunk 97": (_engine(tiny_model_dir, chunk=97), {"a": prompt}),
             "budget shared by 4": (_engine(tiny_model_dir, chunk=80, budget=150), {**others, "a": prompt})}
    for name, (engine, prompts) in cases.items():
        kv, toks = _prompt_kv(engine, prompts, "a")
        assert toks == ref_toks, name
        assert kv.dtype == DTYPE and torch.equal(kv, ref_kv), f"{name}: KV differs from one 512-token chunk"
        engine.check_invariants()


def _decoded_kv(engine: Engine, prompts: dict[str, list[int]], num_decoded: int) -> dict[str, tuple]:
    """Run ``prompts`` together; for each, once it has decoded ``num_decoded`` tokens, the KV its
    blocks hold and the tokens it covers (read from the running request, the engine's own state)."""
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=num_decoded + 3, **GREEDY)))
    seen: dict[str, tuple] = {}
    while len(seen) < len(prompts):
        engine.step()
        for r in engine._running:
            if r.id not in seen and r.num_computed >= len(prompts[r.id]) + num_decoded:
                kv = engine.arrays.gather_tokens(engine.pool.kv, r.blocks, r.num_computed).clone()
                seen[r.id] = (kv, list(r.tokens[:r.num_computed]))
    for rid in prompts:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return seen


def test_decoded_tokens_have_the_kv_a_prefill_gives_them(tiny_model_dir):
    """The KV of generated tokens, computed one decode step at a time, equals the KV a prefill
    computes for the same tokens: so the decode-local append and a migrated decode, which
    re-prefill generated tokens, stay on the oracle's tokens."""
    prompt = random_prompt(701, 200)
    for k in (1, 6, 17):
        (kv, toks), = _decoded_kv(_engine(tiny_model_dir), {"a": prompt}, k).values()
        assert len(toks) == len(prompt) + k
        ref_kv, _ = _prompt_kv(_engine(tiny_model_dir, chunk=64), {"p": toks}, "p")
        assert torch.equal(kv, ref_kv), f"KV after {k} decode steps differs from a prefill of the same tokens"


def test_batched_decode_computes_each_request_as_alone(tiny_model_dir):
    prompts = {f"r{i}": random_prompt(710 + i, 60 + 45 * i) for i in range(6)}
    together = _decoded_kv(_engine(tiny_model_dir, chunk=96, budget=200), prompts, 9)
    for rid, p in prompts.items():
        (kv, toks), = _decoded_kv(_engine(tiny_model_dir), {rid: p}, 9).values()
        assert together[rid][1] == toks, rid
        assert torch.equal(together[rid][0], kv), f"{rid}: KV decoded in a batch of 6 differs from alone"


def test_batch_invariant_kv_is_its_own_namespace(tiny_model_dir):
    plain = Engine(tiny_model_dir, num_blocks=16, dtype=DTYPE)
    inv = _engine(tiny_model_dir, num_blocks=16)
    assert plain.namespace != inv.namespace
    assert inv.namespace.kv_dtype == str(DTYPE).removeprefix("torch.") + "+batch-invariant"
