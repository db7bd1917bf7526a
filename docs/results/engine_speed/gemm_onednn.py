"""Issue 13, session 10 (AMD EPYC, AVX2, float32, 1 thread): the SmolLM2-135M layer linears (x 30 layers,
separate weights) at M rows through (a) OpenBLAS on the transposed ``[in, out]`` storage as the engine
runs them since session 9 (``np.matmul(x, W)``), (b) oneDNN with the weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, what inductor's
weight-prepack pass emits), (c) torch's ``F.linear`` (MKL) and (d) ``torch.mm`` on the ``[in, out]`` storage (MKL, no transpose), interleaved per repetition; thread CPU ms for
all four shapes, median and per-rep speed relative to (a). Also checks (b)'s numerics against (a).

Usage: PYTHONPATH=. python gemm_onednn.py M REPS"""
import os, statistics, sys, time

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from cpd.engine import cpu_blas  # noqa: E402

cpu_blas.linear(torch.randn(20, 576), torch.randn(576, 576))  # numpy's OpenBLAS to torch's 1 thread
M, reps = int(sys.argv[1]), int(sys.argv[2])
shapes = {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536)}
L = 30
g = torch.Generator().manual_seed(0)
W = {k: [torch.randn(*s, generator=g) * 0.02 for _ in range(L)] for k, s in shapes.items()}
WT = {k: [w.t().contiguous() for w in ws] for k, ws in W.items()}  # [in, out] storage
mk = torch.ops.mkldnn
PK = {k: [mk._reorder_linear_weight(w, M) for w in ws] for k, ws in W.items()}
X = {k: torch.randn(M, s[1], generator=g) for k, s in shapes.items()}
for k in shapes:  # numerics
    a = torch.from_numpy(np.matmul(X[k].numpy(), WT[k][0].numpy()))
    b = mk._linear_pointwise(X[k], PK[k][0], None, "none", [], "")
    print(f"{k}: onednn vs openblas max abs diff {(a - b).abs().max().item():.2e}", flush=True)
fns = {
    "openblas": lambda k: [np.matmul(X[k].numpy(), w.numpy()) for w in WT[k]],
    "onednn_packed": lambda k: [mk._linear_pointwise(X[k], w, None, "none", [], "") for w in PK[k]],
    "mkl": lambda k: [F.linear(X[k], w) for w in W[k]],
    "mkl_nn": lambda k: [torch.mm(X[k], w) for w in WT[k]],
}
res = {f: [] for f in fns}
for r in range(reps + 1):
    for f, fn in fns.items():
        t = time.thread_time()
        for k in shapes:
            fn(k)
        if r:
            res[f].append((time.thread_time() - t) * 1e3)
flop = 2 * M * sum(a * b for a, b in shapes.values()) * L
for f in fns:
    rat = [a / b for a, b in zip(res["openblas"], res[f])]
    med = statistics.median(res[f])
    print(f"M={M} {f:14s} {med:7.1f} ms  {flop / med / 1e6:5.1f} GFLOP/s  speed vs openblas "
          f"{statistics.median(rat):.3f} [{min(rat):.3f}-{max(rat):.3f}]", flush=True)
print("load", os.getloadavg())
# the same OpenBLAS on one large square product: what this core reaches when packing is amortised
A, Bm = np.random.rand(2048, 2048).astype(np.float32), np.random.rand(2048, 2048).astype(np.float32)
np.matmul(A, Bm)
big = []
for _ in range(3):
    t = time.thread_time()
    np.matmul(A, Bm)
    big.append(time.thread_time() - t)
print(f"openblas 2048^3: {2 * 2048 ** 3 / statistics.median(big) / 1e9:.1f} GFLOP/s (median of 3)", flush=True)
