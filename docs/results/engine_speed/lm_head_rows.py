"""Issue 13, session 9 (AMD EPYC, AVX2, float32, 1 thread): the tied lm_head (49152 x 576, 113 MB) on the
few rows whose logits are wanted, ways to call it, interleaved per repetition; thread CPU ms per call,
median [min - max] and max |difference| vs F.linear.

  mm_t     torch.mm(w, x.t()).t()  (what model._mm does for <= 16 rows; MKL)
  linear   F.linear(x, w)          (what transformers does; MKL)
  np_wx    np.matmul(w, x.T).T     (OpenBLAS: sgemv for one row)
  np_xw    np.matmul(x, w.T)       (OpenBLAS)

Usage: PYTHONPATH=. python lm_head_rows.py ROWS1,ROWS2 REPS"""
import statistics, sys, time

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
from cpd.engine import cpu_blas  # noqa: E402

rows_list = [int(r) for r in sys.argv[1].split(",")]
reps = int(sys.argv[2])
w = torch.randn(49152, 576) * 0.02
cpu_blas.linear(torch.randn(20, 576), w[:64])  # OpenBLAS threads = torch's
for R in rows_list:
    x = torch.randn(R, 576)
    fns = {
        "mm_t": lambda: torch.mm(w, x.t()).t().contiguous(),
        "linear": lambda: F.linear(x, w),
        "np_wx": lambda: torch.from_numpy(np.ascontiguousarray(np.matmul(w.numpy(), x.numpy().T).T)),
        "np_xw": lambda: torch.from_numpy(np.matmul(x.numpy(), w.numpy().T)),
    }
    ref = F.linear(x, w)
    diffs = {f: (fn() - ref).abs().max().item() for f, fn in fns.items()}
    res = {f: [] for f in fns}
    for r in range(reps + 1):
        for f, fn in fns.items():
            t = time.thread_time()
            fn()
            if r:
                res[f].append((time.thread_time() - t) * 1e3)
    print(f"rows={R} " + "  ".join(f"{f} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}] ms d={diffs[f]:.1e}"
                                   for f, v in res.items()), flush=True)
