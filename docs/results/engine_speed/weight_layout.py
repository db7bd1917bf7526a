"""Issue 13, session 8 (AMD EPYC, AVX2): the four SmolLM2 linears x 30 layers at B rows, weights stored [N, K]
(now) vs stored transposed [K, N] (a [N, K] view), decode-sized (B <= 16: torch/MKL) and prefill-sized (OpenBLAS,
cpu_blas.linear); interleaved reps, thread CPU ms, per-rep speed vs the first. Usage: python weight_layout.py B REPS"""
# decode-sized and prefill-sized linears: current layout [N,K] vs transposed storage [K,N]
import sys, time, torch, statistics, numpy as np
import torch.nn.functional as F
torch.set_num_threads(1)
from cpd.engine import cpu_blas
B = int(sys.argv[1]); reps = int(sys.argv[2])
shapes = {'qkv': (960, 576), 'o': (576, 576), 'gu': (3072, 576), 'down': (576, 1536)}
L = 30
W = {k: [torch.randn(*s) * 0.02 for _ in range(L)] for k, s in shapes.items()}
WTv = {k: [w.t().contiguous().t() for w in ws] for k, ws in W.items()}  # [N,K] views of [K,N] storage
X = {k: torch.randn(B, s[1]) for k, s in shapes.items()}
def small(x, w): return torch.mm(w, x.t()).t().contiguous()
def run(kind):
    for i in range(L):
        for k in shapes:
            x = X[k]
            if kind == 'cur_small': small(x, W[k][i])
            elif kind == 'T_small': small(x, WTv[k][i])
            elif kind == 'T_linear': F.linear(x, WTv[k][i])
            elif kind == 'cur_ob': cpu_blas.linear(x, W[k][i])
            elif kind == 'T_ob': cpu_blas.linear(x, WTv[k][i])
cpu_blas.linear(torch.randn(20, 576), W['o'][0])
kinds = ['cur_small', 'T_small', 'T_linear', 'cur_ob', 'T_ob'] if B <= 16 else ['cur_ob', 'T_ob']
res = {k: [] for k in kinds}
for r in range(reps):
    for k in kinds:
        t = time.thread_time(); run(k); res[k].append((time.thread_time() - t) * 1e3)
base = res[kinds[0]]
for k in kinds:
    rat = [b / v for b, v in zip(base, res[k])]
    print(B, k, 'min', round(min(res[k]), 1), 'med', round(statistics.median(res[k]), 1), 'speed vs first: med', round(statistics.median(rat), 3), 'range', round(min(rat), 3), round(max(rat), 3))
