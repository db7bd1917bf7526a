"""The batch-invariant attention (:func:`cpd.engine.batch_invariant.attend`) computes causal
attention: against torch's SDPA (float32, bottom-right causal mask over a cached prefix) for chunks
and decode rows at block edges and inside blocks, with grouped KV heads; and the tiled linear
computes the linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpd.engine import batch_invariant as bi

NH, NKV, D = 6, 2, 16


def _reference(q, k, v):
    n, L = q.shape[0], k.shape[0]
    mask = torch.ones(n, L, dtype=torch.bool).tril(diagonal=L - n)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(n, NH * D)


@pytest.mark.parametrize("num_new,context", [(1, 1), (1, 128), (1, 129), (1, 300), (7, 7), (128, 128), (129, 256),
                                             (200, 700), (513, 513), (40, 1000)])
def test_attention_is_causal_attention(num_new, context):
    g = torch.Generator().manual_seed(num_new * 1000 + context)
    q = torch.randn(num_new, NH, D, generator=g)
    k, v = torch.randn(context, NKV, D, generator=g), torch.randn(context, NKV, D, generator=g)
    slots = torch.arange(context)
    out = bi.attend(q, k, v, [(0, num_new, slots)], NKV)
    torch.testing.assert_close(out, _reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_attention_of_several_sequences_in_one_batch():
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(600, NKV, D, generator=g), torch.randn(600, NKV, D, generator=g)
    q = torch.randn(1 + 50 + 1, NH, D, generator=g)
    seqs = [(0, 1, torch.arange(0, 200)), (1, 50, torch.arange(200, 500)), (51, 1, torch.arange(500, 600))]
    out = bi.attend(q, k, v, seqs, NKV)
    for qs, n, ctx in seqs:
        torch.testing.assert_close(out[qs:qs + n], _reference(q[qs:qs + n], k[ctx], v[ctx]), rtol=1e-5, atol=1e-5)


def test_tiled_linear_is_the_linear():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    lin = bi.tiled_linear(F.linear)
    for m in (1, 63, 64, 65, 200):
        x = torch.randn(m, 32, generator=g)
        torch.testing.assert_close(lin(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_attention_in_bf16_is_within_bf16_rounding_of_the_float32_result():
    """Whole key blocks go through the flash kernel in the model dtype (its bf16 output is rounded
    before the merge); the result stays within a few bf16 ulps of float32 causal attention."""
    g = torch.Generator().manual_seed(11)
    n, L = 100, 700
    q = torch.randn(n, NH, D, generator=g)
    k, v = torch.randn(L, NKV, D, generator=g), torch.randn(L, NKV, D, generator=g)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = bi.attend(qb, kb, vb, [(0, n, torch.arange(L))], NKV)
    assert out.dtype == torch.bfloat16
    ref = _reference(qb.float(), kb.float(), vb.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_decode_rows_never_read_the_padding_slot():
    """Decode rows of several sequences are gathered into one padded batch; the padding reads
    slot 0 of the pool, whose stale content (here NaN) must not reach any row."""
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(1000, NKV, D, generator=g), torch.randn(1000, NKV, D, generator=g)
    k_cache[0], v_cache[0] = float("nan"), float("nan")
    q = torch.randn(2, NH, D, generator=g)
    seqs = [(0, 1, torch.arange(1, 101)), (1, 1, torch.arange(200, 530))]
    out = bi.attend(q, k_cache, v_cache, seqs, NKV)
    for qs, n, ctx in seqs:
        torch.testing.assert_close(out[qs:qs + n], _reference(q[qs:qs + n], k_cache[ctx], v_cache[ctx]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_whole_block_rows_result_does_not_depend_on_how_many_rows_share_its_call(dtype):
    """The flash calls over whole key blocks: a row's output and log-sum-exp are the same bits whether
    it is called alone, among a few rows, among hundreds, or as another batch entry. The raw kernel
    broke this on an AVX-512 CPU (AMD Zen 4: a call with a tail of 1-3 rows past its 32-row blocks,
    float32), which made a prompt's KV depend on its chunking in batch-invariant mode."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 3, 300, 64, generator=g).to(dtype)
    k = torch.randn(1, 3, bi.KV_BLOCK, 64, generator=g).to(dtype)
    v = torch.randn(1, 3, bi.KV_BLOCK, 64, generator=g).to(dtype)
    o_all, lse_all = bi._flash_block(q, k, v)
    for start, n in [(0, 1), (0, 2), (0, 3), (5, 1), (0, 33), (10, 35), (0, 97), (40, 131), (0, 259), (299, 1)]:
        o, lse = bi._flash_block(q[:, :, start:start + n], k, v)
        assert torch.equal(o, o_all[:, :, start:start + n]) and torch.equal(lse, lse_all[:, :, start:start + n]), (start, n)
    qb = torch.randn(4, 3, 3, 64, generator=g).to(dtype)  # decode rows: the sequences as the batch
    qb[2] = q[0, :, 7:10]
    kb, vb = k.expand(4, -1, -1, -1).clone(), v.expand(4, -1, -1, -1).clone()
    ob, lb = bi._flash_block(qb, kb, vb)
    assert torch.equal(ob[2], o_all[0, :, 7:10]) and torch.equal(lb[2], lse_all[0, :, 7:10])
