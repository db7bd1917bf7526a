"""Issue 13, session 9 (AMD EPYC, AVX2, float32, 1 thread): each SmolLM2-135M layer linear separately
(x 30 layers, separate weights), M rows, backends interleaved per repetition; thread CPU ms, median and
the per-rep speed relative to ``np`` (OpenBLAS as cpu_blas.linear calls it).

  np      np.matmul(x, w.T) (OpenBLAS)          np_out  the same into a reused output
  mkl     F.linear (MKL)                        mkl_out torch.mm(x, w.t(), out=a reused output)

Usage: PYTHONPATH=. python gemm_per_shape.py M REPS"""
import statistics, sys, time

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from cpd.engine import cpu_blas  # noqa: E402

M, reps = int(sys.argv[1]), int(sys.argv[2])
shapes = {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536)}
L = 30
W = {k: [torch.randn(*s) * 0.02 for _ in range(L)] for k, s in shapes.items()}
cpu_blas.linear(torch.randn(20, 576), W["o"][0])
for k, (n, kk) in shapes.items():
    x = torch.randn(M, kk)
    out_np = np.empty((M, n), np.float32)
    out_t = torch.empty(M, n)
    fns = {
        "np": lambda w: np.matmul(x.numpy(), w.numpy().T),
        "np_out": lambda w: np.matmul(x.numpy(), w.numpy().T, out=out_np),
        "mkl": lambda w: F.linear(x, w),
        "mkl_out": lambda w: torch.mm(x, w.t(), out=out_t),
    }
    res = {f: [] for f in fns}
    for r in range(reps + 1):
        for f, fn in fns.items():
            t = time.thread_time()
            for i in range(L):
                fn(W[k][i])
            if r:
                res[f].append((time.thread_time() - t) * 1e3)
    line = []
    for f in fns:
        rat = [a / b for a, b in zip(res["np"], res[f])]
        line.append(f"{f} {statistics.median(res[f]):.1f} ms ({statistics.median(rat):.2f} [{min(rat):.2f}-{max(rat):.2f}])")
    print(f"M={M} {k:4s} " + "  ".join(line), flush=True)
