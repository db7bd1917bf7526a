"""KV export for the handoff: the old path (gather into a new tensor, then copy into the
staging buffer, as ``export_kv`` + ``HandoffSender.stage`` do) vs ``export_kv_into`` (one
gather straight into the staging buffer) vs a plain memory copy of the same bytes, on a pool
shaped like SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64, blocks of 16 tokens, blocks
scattered in the pool). Interleaved, medians, GB/s of KV bytes.

Usage::

    .venv/bin/python benchmarks/bench_kv_export.py [--tokens 1024,8192] [--reps 15] [--threads 1]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from cpd.engine.kv_arrays import TorchKVArrays

L, H, D, BS = 30, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        arrays = TorchKVArrays(dtype)
        for n in [int(x) for x in a.tokens.split(",")]:
            nb = -(-n // BS)
            pool = torch.randn(L, 2, 4 * nb, BS, H, D).to(dtype)
            blocks = torch.randperm(4 * nb)[:nb].tolist()
            nbytes = L * 2 * n * H * D * pool.element_size()
            arena = np.empty(nbytes, dtype=np.uint8)  # the staging buffer
            src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

            def old():
                kv = arrays.gather_tokens(pool, blocks, n)
                np.copyto(arena, arrays.to_numpy(kv).reshape(-1).view(np.uint8))

            def new():
                arrays.gather_tokens_into(pool, blocks, n, arena)

            def memcpy():
                np.copyto(arena, src)

            ts = {"old_export_then_stage": [], "export_kv_into": [], "memcpy": []}
            for _ in range(a.reps):
                for k, f in zip(ts, (old, new, memcpy)):
                    t = time.perf_counter()
                    f()
                    ts[k].append(time.perf_counter() - t)
            key = f"{str(dtype).replace('torch.', '')}/{n}"
            out[key] = {k: {"ms": statistics.median(v) * 1e3, "GB_s": nbytes / statistics.median(v) / 1e9}
                        for k, v in ts.items()}
            print(key, f"{nbytes / 1e6:.1f} MB:", " | ".join(f"{k} {d['ms']:.2f} ms {d['GB_s']:.1f} GB/s"
                                                             for k, d in out[key].items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
