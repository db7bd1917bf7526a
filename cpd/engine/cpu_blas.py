"""float32 CPU matmuls of prefill-sized linears through numpy's OpenBLAS instead of torch's MKL.

Why: on an AMD EPYC (Zen 3, AVX2), 1 thread, the SmolLM2-135M prefill linears (30 layers ×
qkv / o / gate-up / down) took 12 – 23 % less CPU time with the OpenBLAS that numpy ships
(Haswell kernels) than with MKL's ``sgemm`` (what ``F.linear`` calls), interleaved: 128 rows
469 vs 362 ms, 512 rows 1504 vs 1323 ms (min of 12), 2048 rows 6435 vs 5524 ms (median of 5)
(``docs/results/engine_speed/gemm_backends.py``); MKL's verbose mode names no AVX2 code path on
that CPU ("Intel(R) Architecture processors"). oneDNN and MKL's packed weights gained at most
13 % at 128 rows and nothing at 512.
MKL is Intel's library, so the policy is: OpenBLAS for float32 CPU linears when the CPU is not
an Intel one and numpy's OpenBLAS can be found (its thread count is then set to torch's before
each call, so the two never run more threads than asked). ``CPD_CPU_GEMM=torch`` or
``=openblas`` overrides the choice (``openblas`` still needs the library).

:func:`wanted` is that policy; :func:`linear` the mechanism (``x @ w.T`` + bias for a 2-D float32
CPU ``x``). The model uses it for linears of more than ``SMALL_ROWS`` rows (prefill); decode-sized
linears keep torch's kernels.
"""
from __future__ import annotations

import ctypes
import glob
import os
from functools import lru_cache

import numpy as np
import torch

_SET_THREADS_NAMES = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                      "openblas_set_num_threads64_", "openblas_set_num_threads")


@lru_cache(maxsize=1)
def _set_threads_fn():
    """numpy's OpenBLAS ``set_num_threads`` (ctypes), or None when numpy has no OpenBLAS."""
    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "*openblas*.so*"))):
        lib = ctypes.CDLL(path)  # already loaded by numpy: the same handle
        for name in _SET_THREADS_NAMES:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], None
                return fn
    return None


@lru_cache(maxsize=1)
def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Policy: use :func:`linear` for this model's prefill linears (see module docstring)."""
    if device.type != "cpu" or dtype != torch.float32:
        return False
    choice = os.environ.get("CPD_CPU_GEMM", "auto")
    if choice == "torch":
        return False
    if _set_threads_fn() is None:
        return False
    return choice == "openblas" or _cpu_vendor() not in ("GenuineIntel", "")


_threads = [0]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for a 2-D float32 CPU ``x`` by OpenBLAS ``sgemm`` (``w`` read
    transposed in place, no copy; ``x`` may be a view with strided rows), with torch's current
    thread count."""
    n = torch.get_num_threads()
    if n != _threads[0]:
        fn = _set_threads_fn()
        assert fn is not None, "cpu_blas.linear without numpy's OpenBLAS (check wanted())"
        fn(n)
        _threads[0] = n
    if x.stride(-1) != 1 or x.stride(0) < x.shape[1]:  # else BLAS reads the rows in place (lda)
        x = x.contiguous()
    y = torch.from_numpy(np.matmul(x.numpy(), w.numpy().T))
    return y if b is None else y + b
