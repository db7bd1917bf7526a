"""Issue 13, session 9 (AMD EPYC, AVX2, float32, 1 thread): causal prefill attention of one sequence of T
tokens with SmolLM2-135M's heads (9 query / 3 KV heads, d 64), x 30 layers, interleaved per repetition,
thread CPU ms:

  flash    F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on head-major operands (the model now)
  matmul   the query heads of a KV head folded into the rows ([3, 3T, 64]): baddbmm with an additive causal
           mask, softmax, bmm (MKL batched sgemm); computes every score (no causal skipping)

and the max |difference| of the outputs. Usage: python attn_small_t.py T1,T2 REPS"""
import math, statistics, sys, time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
Ts = [int(t) for t in sys.argv[1].split(",")]
reps = int(sys.argv[2])
nh, nkv, d, L = 9, 3, 64, 30
g = nh // nkv


def matmul_attn(q, k, v, mask):
    T = q.shape[2]
    s = torch.baddbmm(mask, q.reshape(nkv, g * T, d), k[0].transpose(1, 2), alpha=1.0 / math.sqrt(d))
    return torch.bmm(s.softmax(-1), v[0]).view(1, nh, T, d)


for T in Ts:
    gen = torch.Generator().manual_seed(T)
    qs = [torch.randn(1, nh, T, d, generator=gen) for _ in range(L)]
    ks = [torch.randn(1, nkv, T, d, generator=gen) for _ in range(L)]
    vs = [torch.randn(1, nkv, T, d, generator=gen) for _ in range(L)]
    a = F.scaled_dot_product_attention(qs[0], ks[0], vs[0], is_causal=True, enable_gqa=True)
    mask = torch.full((T, T), float("-inf")).triu_(1).repeat(g, 1)  # [g*T, T], row r is token r % T
    b = matmul_attn(qs[0], ks[0], vs[0], mask)
    diff = (a - b).abs().max().item()
    res = {"flash": [], "matmul": []}
    for r in range(reps + 1):
        t = time.thread_time()
        for i in range(L):
            F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True, enable_gqa=True)
        t1 = time.thread_time()
        m = torch.full((T, T), float("-inf")).triu_(1).repeat(g, 1)  # once per step in the model
        for i in range(L):
            matmul_attn(qs[i], ks[i], vs[i], m)
        t2 = time.thread_time()
        if r:
            res["flash"].append((t1 - t) * 1e3)
            res["matmul"].append((t2 - t1) * 1e3)
    rat = [f / m for f, m in zip(res["flash"], res["matmul"])]
    print(f"T={T} x{L} layers: flash med {statistics.median(res['flash']):.1f} ms, matmul med "
          f"{statistics.median(res['matmul']):.1f} ms, flash/matmul med {statistics.median(rat):.2f} "
          f"[{min(rat):.2f} - {max(rat):.2f}], max|diff| {diff:.2e}", flush=True)
