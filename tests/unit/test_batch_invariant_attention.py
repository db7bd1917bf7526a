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
