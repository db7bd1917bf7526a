"""Issue 13, session 9 (AMD EPYC, AVX2, float32, 1 thread): the SmolLM2-135M layer linears x 30 layers
at M rows, ways of calling OpenBLAS (numpy's) and MKL, interleaved per repetition; thread CPU ms and
minor page faults per pass. Also SwiGLU on the strided gate/up halves vs contiguous.

  np       cpu_blas.linear as in 7620ea4: np.matmul(x, w.T), a new output each call
  np_out   np.matmul(x, w.T, out=a buffer reused across calls)
  np_wx    np.matmul(w, x.T) (the weight as BLAS's left operand), then .T made contiguous
  mkl      F.linear (MKL sgemm; what transformers runs)
  blis     cython-blis's gemm (BLIS, its own kernels), when ``blis`` imports (not a cpd dependency:
           the wheel was installed with ``pip install --target`` outside the venv for this trial)

Usage: PYTHONPATH=. python gemm_small_m.py M1,M2 REPS"""
import resource, statistics, sys, time

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from cpd.engine import cpu_blas  # noqa: E402

Ms = [int(m) for m in sys.argv[1].split(",")]
reps = int(sys.argv[2])
shapes = {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536)}
L = 30
W = {k: [torch.randn(*s) * 0.02 for _ in range(L)] for k, s in shapes.items()}
cpu_blas.linear(torch.randn(20, 576), W["o"][0])  # sets OpenBLAS's threads
try:
    from blis.py import gemm as blis_gemm
except ImportError:
    blis_gemm = None


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


for M in Ms:
    X = {k: torch.randn(M, s[1]) for k, s in shapes.items()}
    bufs = {k: np.empty((M, s[0]), np.float32) for k, s in shapes.items()}
    fns = {
        "np": lambda k, x, w: cpu_blas.linear(x, w),
        "np_out": lambda k, x, w: torch.from_numpy(np.matmul(x.numpy(), w.numpy().T, out=bufs[k])),
        "np_wx": lambda k, x, w: torch.from_numpy(np.matmul(w.numpy(), x.numpy().T).T.copy()),
        "mkl": lambda k, x, w: F.linear(x, w),
    }
    if blis_gemm is not None:
        fns["blis"] = lambda k, x, w: torch.from_numpy(blis_gemm(x.numpy(), w.numpy(), trans2=True, beta=0.0))
    for n, f in fns.items():
        d = (f("qkv", X["qkv"], W["qkv"][0]) - F.linear(X["qkv"], W["qkv"][0])).abs().max().item()
        assert d < 1e-4, (n, d)
    res = {n: [] for n in fns}
    flt = {n: [] for n in fns}
    for r in range(reps + 1):
        for n, f in fns.items():
            f0 = faults()
            t = time.thread_time()
            for i in range(L):
                for k in shapes:
                    f(k, X[k], W[k][i])
            dt = (time.thread_time() - t) * 1e3
            if r:
                res[n].append(dt)
                flt[n].append(faults() - f0)
    base = res["np"]
    for n in fns:
        rat = [b / v for b, v in zip(base, res[n])]
        print(f"M={M} {n:7s} med {statistics.median(res[n]):7.1f} ms min {min(res[n]):7.1f} "
              f"speed vs np: med {statistics.median(rat):.3f} [{min(rat):.3f} - {max(rat):.3f}] "
              f"faults/pass {statistics.median(flt[n])}", flush=True)
    # SwiGLU on the fused gate/up output (strided halves, as the model does) vs contiguous halves
    gu = torch.randn(M, 3072)
    inter = 1536
    g_c, u_c = gu[:, :inter].contiguous(), gu[:, inter:].contiguous()
    sw = {"strided": [], "contig": []}
    for r in range(reps + 1):
        a = gu.clone()
        t = time.thread_time()
        for _ in range(L):
            F.silu(a[:, :inter], inplace=True).mul_(a[:, inter:])
        d1 = time.thread_time() - t
        g = g_c.clone()
        t = time.thread_time()
        for _ in range(L):
            F.silu(g, inplace=True).mul_(u_c)
        d2 = time.thread_time() - t
        if r:
            sw["strided"].append(d1 * 1e3)
            sw["contig"].append(d2 * 1e3)
    print(f"M={M} swiglu x{L}: strided med {statistics.median(sw['strided']):.2f} ms, "
          f"contiguous med {statistics.median(sw['contig']):.2f} ms", flush=True)
