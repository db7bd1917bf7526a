"""GEMM backends for the SmolLM2-135M prefill linears on this CPU (issue 13, AMD EPYC prefill).

30 layers x (qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576), separate weights per
layer (out of cache, like the model), float32, M rows; every repetition runs every backend back to
back (interleaved); CPU seconds (time.process_time); min and median of REPS (first dropped).
Backends: F.linear (MKL sgemm), mm with a pre-transposed weight, MKL packed weights
(torch.ops.mkl._mkl_linear), numpy's OpenBLAS (np.matmul), oneDNN (mkldnn._linear_pointwise).

Usage: OPENBLAS_NUM_THREADS=1 python gemm_backends.py THREADS M1,M2,... REPS
"""
import sys, time, statistics, torch
import torch.nn.functional as F
import numpy as np
torch.set_num_threads(int(sys.argv[1]))
Ms = [int(m) for m in sys.argv[2].split(",")]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
shapes = {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536)}
L = 30  # separate weights per layer, like the model (out of cache)
ws = {k: [torch.randn(n, kk) * 0.02 for _ in range(L)] for k, (n, kk) in shapes.items()}
wt = {k: [w.t().contiguous() for w in v] for k, v in ws.items()}
wtn = {k: [w.numpy() for w in v] for k, v in wt.items()}
def run_layers(M, fn_by_kind):
    xs = {k: torch.randn(M, kk) for k, (n, kk) in shapes.items()}
    t = time.process_time()
    for l in range(L):
        for k in shapes:
            fn_by_kind(k, l, xs[k])
    return time.process_time() - t
for M in Ms:
    mkl_p = {k: [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in v] for k, v in ws.items()}
    dnn_p = {k: [torch.ops.mkldnn._reorder_linear_weight(w, M) for w in v] for k, v in ws.items()}
    fns = {
        "F.linear": lambda k, l, x: F.linear(x, ws[k][l]),
        "mm(x,wT)": lambda k, l, x: torch.mm(x, wt[k][l]),
        "mkl_packed": lambda k, l, x: torch.ops.mkl._mkl_linear(x, mkl_p[k][l], ws[k][l], None, M),
        "openblas": lambda k, l, x: torch.from_numpy(np.matmul(x.numpy(), wtn[k][l])),
        "onednn": lambda k, l, x: torch.ops.mkldnn._linear_pointwise(x, dnn_p[k][l], None, "none", [None], ""),
    }
    # check
    x = torch.randn(M, 576)
    ref = F.linear(x, ws["qkv"][0])
    for name, f in fns.items():
        err = (f("qkv", 0, x) - ref).abs().max().item()
        assert err < 1e-3, (name, err)
    res = {n: [] for n in fns}
    for r in range(reps + 1):
        for n, f in fns.items():
            t = run_layers(M, f)
            if r: res[n].append(t)
    base = min(res["F.linear"])
    print(f"M={M}: " + "  ".join(f"{n} min {min(v)*1e3:.0f} med {statistics.median(v)*1e3:.0f} x{base/min(v):.2f}" for n, v in res.items()), flush=True)
