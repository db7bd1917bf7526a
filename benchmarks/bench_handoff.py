"""Same-host KV handoff bandwidth vs a plain numpy memcpy of the same bytes.

The sender (this process) stages a KV array into its shared-memory arena; a receiver in a
second process takes it and reports its time. Three receiver modes:

* ``fetch``: copy out into a preallocated buffer — bytes / (stage + fetch), two copies, so
  about half of memcpy is the ceiling;
* ``view``: what the decode worker does — a zero-copy view of the arena that the engine then
  copies straight into its KV pool (a copy it needs in any design); bytes / (stage + view), one
  copy;
* ``tcp``: the cross-host path over loopback, for reference.

Usage: python benchmarks/bench_handoff.py [--mb 32] [--n 20]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from cpd.worker.handoff import HandoffSender

ROOT = Path(__file__).resolve().parents[1]

_RECEIVER = r"""
import json, sys, time, numpy as np
from cpd.worker.handoff import HandoffReceiver
r = HandoffReceiver(force_tcp=sys.argv[1] == "tcp")
mode = sys.argv[1]
out = None
for line in sys.stdin:
    h = json.loads(line)
    if out is None:
        out = np.empty(h["shape"], dtype=h["dtype"])
        out.fill(0)  # pre-fault the destination once, as a decode worker's buffer would be
    t0 = time.perf_counter()
    if mode == "view":
        v = r.view(h)
    else:
        r.fetch(h, out=out)
    print(json.dumps({"fetch_s": time.perf_counter() - t0, "path": r.path_for(h)}), flush=True)
"""


def run(mode: str, a: np.ndarray, n: int) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", _RECEIVER, mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    best, path = float("inf"), ""
    with HandoffSender(arena_bytes=a.nbytes + (1 << 20)) as s:
        try:
            for i in range(n):
                t0 = time.perf_counter()
                h = s.stage(f"r{i}", a)
                t_stage = time.perf_counter() - t0
                p.stdin.write(msgspec.json.encode(h).decode() + "\n")
                p.stdin.flush()
                rep = json.loads(p.stdout.readline())
                s.release(f"r{i}")
                best = min(best, t_stage + rep["fetch_s"])
                path = rep["path"]
        finally:
            p.stdin.close()
            p.wait(30)
    return a.nbytes / best / 1e9, path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=32)
    ap.add_argument("--n", type=int, default=20)
    a = ap.parse_args()
    tokens = max(1, int(a.mb * (1 << 20) / (24 * 2 * 8 * 64 * 4)))
    kv = np.random.default_rng(0).standard_normal((24, 2, tokens, 8, 64)).astype(np.float32)
    dst = np.empty_like(kv)
    dst.fill(0)
    best = float("inf")
    for _ in range(a.n):
        t0 = time.perf_counter()
        np.copyto(dst, kv)
        best = min(best, time.perf_counter() - t0)
    memcpy = kv.nbytes / best / 1e9
    shm, p1 = run("auto", kv, a.n)
    view, _ = run("view", kv, a.n)
    tcp, p2 = run("tcp", kv, max(3, a.n // 4))
    print(f"KV array {kv.shape} float32 = {kv.nbytes / 1e6:.1f} MB, best of {a.n}")
    print(f"numpy memcpy            : {memcpy:6.2f} GB/s")
    print(f"handoff {p1:3s} (stage+fetch): {shm:6.2f} GB/s   ratio to memcpy {shm / memcpy:.2f}")
    print(f"handoff shm (stage+view) : {view:6.2f} GB/s   ratio to memcpy {view / memcpy:.2f}")
    print(f"handoff {p2:3s} (stage+fetch): {tcp:6.2f} GB/s   ratio to memcpy {tcp / memcpy:.2f}")


if __name__ == "__main__":
    main()
