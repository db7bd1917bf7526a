"""How much faster is making a 2K-token SmolLM2 prefix warm from L3 than recomputing it?

Measured side by side in one run, same process, same prompt:

- recompute: a fresh engine without L3 prefills the whole prompt (first token only);
- load:      a fresh engine whose L3 connector holds the prefix (written by a first engine
             through write-through) loads the prefix and computes only the last block's tokens;
- raw load:  the connector's ``load`` of the prefix blocks alone (store read + checksum).

Usage: ``.venv/bin/python benchmarks/bench_warm_prefix.py [--tokens 2048] [--store file:///dev/shm/x|redis://...]``
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np


def main() -> None:
    from cpd.engine.engine import Engine
    from cpd.engine.sampling import SamplingParams
    from cpd.engine.weights import default_model_dir
    from cpd.kv.block_hash import hash_blocks
    from cpd.store import open_store
    from cpd.store.connector import L3Connector

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--store", default="")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 = as each worker runs here)")
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    tmp = None
    url = a.store
    if not url:
        tmp = tempfile.mkdtemp(prefix="cpd-bench-l3-", dir="/dev/shm")
        url = f"file://{tmp}"
    model = str(default_model_dir())
    prompt = [int(x) for x in np.random.default_rng(0).integers(100, 40000, size=a.tokens + 1)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    nblocks = (a.tokens + 1 + 15) // 16 + 4

    writer = L3Connector(open_store(url), write_async=False)
    Engine(model, num_blocks=nblocks, connector=writer).generate(prompt, sp, write_through=True)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    recompute_s = timed(lambda: Engine(model, num_blocks=nblocks).generate(prompt, sp))
    # engine construction is inside both timings; measure it alone to subtract
    build_s = timed(lambda: Engine(model, num_blocks=nblocks))
    reader = L3Connector(open_store(url), write_async=False)
    load_s = timed(lambda: Engine(model, num_blocks=nblocks, connector=reader).generate(prompt, sp))
    eng = Engine(model, num_blocks=nblocks)
    hashes = hash_blocks(prompt, eng.namespace)
    raw_s = timed(lambda: reader.load(hashes))
    nbytes = sum(b.nbytes for b in reader.load(hashes))
    rec, ld = recompute_s - build_s, load_s - build_s
    print(f"prefix {len(hashes) * 16} tokens, {nbytes / 1e6:.1f} MB of KV, store {url.split('?')[0]}")
    print(f"recompute (TTFT, first token) : {rec * 1e3:8.1f} ms")
    print(f"warm from L3 (TTFT)           : {ld * 1e3:8.1f} ms   -> {rec / ld:5.1f}x faster")
    print(f"raw L3 load of the prefix     : {raw_s * 1e3:8.1f} ms   -> {rec / raw_s:5.1f}x faster, "
          f"{nbytes / raw_s / 1e9:.2f} GB/s")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
