"""The engine's compute and KV dtype from a name (the ``--dtype`` option of every command
that runs an engine).

``auto`` is bfloat16 where the hardware computes it natively — CUDA devices with bf16
support, CPUs with AVX512-BF16 or AMX-BF16 (oneDNN then runs bf16 matmuls in hardware) —
and float32 otherwise (a CPU without them emulates bf16 and is slower than float32).
float16 is offered on CUDA only (CPU matmuls in float16 are emulated).
The dtype is also the KV dtype, so it is part of the block-hash namespace (``kv_dtype``):
engines of different dtypes never share KV blocks.
"""
from __future__ import annotations

import torch

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16}
CHOICES = ("auto", "float32", "bfloat16", "float16")


def cpu_has_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU flags name AVX512-BF16 or AMX-BF16 (False where they cannot be read)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(name: str | torch.dtype | None, device: str | torch.device = "cpu") -> torch.dtype:
    """``name`` (``auto``, ``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``, a
    torch dtype, or None = auto) → torch dtype for ``device``.

    Raises:
        ValueError: unknown name, or float16 on a CPU.
    """
    dev = torch.device(device)
    if isinstance(name, torch.dtype):
        dt = name
    elif name is None or str(name).lower() == "auto":
        if dev.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    else:
        found = DTYPE_NAMES.get(str(name).lower())
        if found is None:
            raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(CHOICES)}")
        dt = found
    if dt == torch.float16 and dev.type != "cuda":
        raise ValueError("float16 is supported on CUDA only; use bfloat16 or float32 on a CPU")
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dt}: use one of {', '.join(CHOICES)}")
    return dt
