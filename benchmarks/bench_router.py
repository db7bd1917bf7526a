"""Router decision time per prompt length: block hashing + prefix-index match + policy,
exactly the work of ``Dispatcher.decide`` (no HTTP), against an index of about a million
block hashes spread over 8 prefill-side workers (L1 and L2) and the L3 store.

Two cases per prompt length, interleaved:

* ``cold``: a prompt never seen before (every block is hashed);
* ``grown``: a session's next turn (the previous prompt + 256 new tokens), whose already
  hashed prefix comes from the hash cache (``cpd.kv.block_hash``).

Usage::

    .venv/bin/python benchmarks/bench_router.py [--lengths 2048,32768,131072] [--reps 30]
        [--indexed-blocks 1000000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.kv.events import MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, BlockStored, KVEventBatch
from cpd.policy.routing import LinearCostModel, RoutingConfig, WorkerLoad, route
from cpd.router.index import PrefixIndex

NS = Namespace(model_id="bench", weights_digest="w", tokenizer_digest="t")
BS = NS.block_size
WORKERS = [f"p{i}" for i in range(8)]


def _stored(hs, medium):
    return BlockStored(block_hashes=list(hs), parent_block_hash=None, token_ids=[], block_size=BS, medium=medium)


def build_index(indexed_blocks: int, rng: random.Random) -> PrefixIndex:
    """~``indexed_blocks`` random hashes: per worker L1 and L2 sets, plus 16-block L3 chunks."""
    idx = PrefixIndex()
    per = indexed_blocks // (2 * len(WORKERS) + 1)
    for w in WORKERS:
        evs = [_stored([rng.getrandbits(64) for _ in range(per)], m) for m in (MEDIUM_L1, MEDIUM_L2)]
        idx.apply_batch(w, 0, KVEventBatch(ts=0, events=evs))
    l3 = [_stored([rng.getrandbits(64) for _ in range(16)], MEDIUM_L3) for _ in range(per // 16)]
    idx.apply_batch("pp", 0, KVEventBatch(ts=0, events=l3))
    return idx


def decide(idx: PrefixIndex, tokens: list[int], loads, cfg, cost):
    hs = hash_blocks(tokens, NS)
    m = idx.match(hs, l3_max_blocks=(len(tokens) - 1) // BS)
    return route(len(tokens), m, loads, cfg, cost)


def _seed_prompt(idx: PrefixIndex, tokens: list[int]) -> None:
    """Make the prompt's head warm somewhere: p0 holds half in L1, the next quarter in L2."""
    hs = hash_blocks(tokens, NS)
    n = len(hs)
    idx.apply_batch("p0", 10**9 + len(tokens), KVEventBatch(ts=0, events=[
        _stored(hs[:n // 2], MEDIUM_L1), _stored(hs[n // 2:3 * n // 4], MEDIUM_L2)]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,32768,131072")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--indexed-blocks", type=int, default=1_000_000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = random.Random(0)
    t0 = time.perf_counter()
    idx = build_index(a.indexed_blocks, rng)
    print(f"index built in {time.perf_counter() - t0:.1f} s: {idx.sizes()}")
    loads = [WorkerLoad(w, "pre-prefill" if i % 2 else "prefill") for i, w in enumerate(WORKERS)] + [
        WorkerLoad("d0", "decode")]
    cfg, cost = RoutingConfig(block_size=BS), LinearCostModel(kv_bytes_per_token=18432)
    out: dict[str, dict] = {}
    for n in [int(x) for x in a.lengths.split(",")]:
        cold_ms, grown_ms = [], []
        session = [rng.randrange(50000) for _ in range(n - 256)]
        _seed_prompt(idx, session)
        decide(idx, session, loads, cfg, cost)
        for _ in range(a.reps):
            cold = [rng.randrange(50000) for _ in range(n)]
            t = time.perf_counter()
            decide(idx, cold, loads, cfg, cost)
            cold_ms.append((time.perf_counter() - t) * 1e3)
            grown = session + [rng.randrange(50000) for _ in range(256)]
            t = time.perf_counter()
            d = decide(idx, grown, loads, cfg, cost)
            grown_ms.append((time.perf_counter() - t) * 1e3)
        assert d.load_plan.l1_blocks > 0 and d.load_plan.l2_blocks > 0, d
        out[str(n)] = {k: {"p50_ms": statistics.median(v), "p99_ms": _p99(v)}
                       for k, v in (("cold", cold_ms), ("grown", grown_ms))}
        print(f"{n:>7} tokens: cold p50 {out[str(n)]['cold']['p50_ms']:.2f} ms p99 {out[str(n)]['cold']['p99_ms']:.2f}"
              f" ms | grown p50 {out[str(n)]['grown']['p50_ms']:.2f} ms p99 {out[str(n)]['grown']['p99_ms']:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"router_decision": out, "indexed_blocks": idx.sizes()}, f, indent=1)


def _p99(v: list[float]) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


if __name__ == "__main__":
    main()
