"""``--dtype``: name resolution (auto = bf16 where the CPU/GPU computes it natively), and the
oracle at bfloat16 on a tiny random Llama: logits within a stated tolerance of transformers
at the same dtype, and greedy tokens identical across our own paths (cold, prefix-cache hit,
L2 promotion, chunked prefill, batched decode). The float32 oracle lives in test_model.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cpd.engine.dtype import cpu_has_native_bf16, resolve_dtype
from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.model import SeqBatchInfo, build_metadata
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.engine.weights import load_model_dir, make_tiny_llama_dir

BF16_LOGIT_TOL = 0.05  # max |logit difference| vs transformers in bf16 (measured 0.0 on this model)
BS = 4
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def test_resolve_names_and_auto(tmp_path):
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("fp32") is torch.float32
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.bfloat16) is torch.bfloat16
    assert resolve_dtype("auto") is (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8")
    yes, no = tmp_path / "yes", tmp_path / "no"
    yes.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile\n")
    no.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_has_native_bf16(str(yes)) and not cpu_has_native_bf16(str(no))
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))


def test_dtype_flag_reaches_the_engine_config():
    from cpd.config import build_config
    assert build_config(overrides={"engine.dtype": "float32"}).engine.dtype == "float32"
    assert build_config().engine.dtype == "auto"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def test_bf16_logits_match_transformers_bf16(model_dir):
    from transformers import LlamaForCausalLM
    model, cfg = load_model_dir(model_dir, dtype=torch.bfloat16)
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(7))
    nb = -(-45 // 8)
    kv = torch.zeros(cfg.num_hidden_layers, 2, nb, 8, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
    ours = model(ids, build_metadata([SeqBatchInfo(0, 45, list(range(nb))[::-1])], 8), kv)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    assert (ours - ref).abs().max().item() < BF16_LOGIT_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def _bf16(model_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    return Engine(model_dir, block_size=BS, dtype=torch.bfloat16, **kw)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(10, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_bf16_greedy_tokens_identical_across_paths(model_dir):
    p = _prompt(1, 70)
    ref = _bf16(model_dir).generate(p, GREEDY)
    warm = _bf16(model_dir)
    warm.generate(p[:33], GREEDY)
    assert warm.generate(p, GREEDY) == ref  # prefix from L1
    chunked = _bf16(model_dir, scheduler_config=SchedulerConfig(max_num_batched_tokens=16,
                                                                 max_prefill_chunk_tokens=16))
    assert chunked.generate(p, GREEDY) == ref
    l2 = _bf16(model_dir, num_blocks=24, host_kv_bytes=1 << 20)
    l2.generate(p, GREEDY)
    l2.generate(_prompt(2, 70), GREEDY)  # pushes p's blocks into L2
    assert l2.generate(p, GREEDY) == ref
    assert l2.host_pool.stats()["num_hits"] > 0
    # batched decode: four prompts together == each alone
    ps = [_prompt(10 + i, 20 + 7 * i) for i in range(4)]
    e = _bf16(model_dir)
    for i, q in enumerate(ps):
        e.add_request(EngineRequest(f"r{i}", q, GREEDY))
    got: dict[str, list[int]] = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [got[f"r{i}"] for i in range(4)] == [_bf16(model_dir).generate(q, GREEDY) for q in ps]


def test_kv_dtype_is_in_the_namespace(model_dir):
    a, b = _bf16(model_dir), Engine(model_dir, num_blocks=8, block_size=BS)
    assert a.namespace.kv_dtype == "bfloat16" and b.namespace.kv_dtype == "float32"
    assert a.namespace.root_hash() != b.namespace.root_hash()
    assert a.kv_bytes_per_token * 2 == b.kv_bytes_per_token


def test_bf16_kv_through_l3_store_and_handoff_bytes(model_dir, tmp_path):
    """bf16 KV leaves the engine as raw 16-bit patterns (numpy has no bf16) and comes back
    exactly: warm from a real file:// L3 store == cold, and a handoff through numpy decodes
    to the same tokens."""
    from cpd.store import open_store
    from cpd.store.connector import L3Connector
    p = _prompt(7, 41)
    ref = _bf16(model_dir).generate(p, GREEDY)
    url = f"file://{tmp_path}/l3"
    writer = _bf16(model_dir, connector=L3Connector(open_store(url), write_async=False))
    writer.add_request(EngineRequest("w", p, GREEDY, write_through=True, mode="prefill"))
    while writer.has_unfinished():
        writer.step()
    kv = writer.arrays.to_numpy(writer.export_kv("w")[0])
    assert kv.dtype == np.int16
    writer.release("w")
    warm = _bf16(model_dir, connector=L3Connector(open_store(url), write_async=False))
    warm.add_request(EngineRequest("x", p, GREEDY))
    out, tiers = [], None
    while warm.has_unfinished():
        for o in warm.step():
            out.extend(o.new_token_ids)
            tiers = tiers or o.num_cached_tokens_by_tier
    assert tiers["L3"] == 40 and out == ref
    dec = _bf16(model_dir)
    first = ref[:1]
    dec.add_decode_request("d", p + first, kv, GREEDY)
    got = list(first)
    while dec.has_unfinished():
        for o in dec.step():
            got.extend(o.new_token_ids)
    assert got == ref
