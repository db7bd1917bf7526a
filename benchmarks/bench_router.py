"""Router decision time per prompt length: block hashing + prefix-index match + policy,
exactly the work of ``Dispatcher.decide`` (no HTTP), against an index of about a million
block hashes spread over 8 prefill-side workers (L1 and L2) and the L3 store.

Three cases per prompt length, interleaved:

* ``cold``: a prompt never seen before (every block is hashed);
* ``grown``: a session's next turn (the previous prompt + 256 new tokens), whose head is warm
  in the index (p0 holds its first half in L1 and the next quarter in L2). Both hash paths
  take the already hashed prefix from their cache (``cpd.kv.block_hash``: the C path's prefix
  cache, the pure-Python path's group LRU) and hash the rest; ``--no-prefix-cache`` makes the
  C path hash it whole (the "before" of the prefix cache);
* ``grown_l3``: another session's next turn whose previous prompt is in the shared L3 store
  only (written through in 16-block chunks), in no worker's L1/L2.

Times are wall clock (p50, p99); ``cpu_p50_ms``/``cpu_p99_ms`` are the process CPU time of
a decision (on a shared machine the wall clock also counts waiting for a core).
``--breakdown`` also times the three parts of a cold and of a grown decision separately
(hashing, index match, policy), interleaved with the whole decisions, and the hashing cost
per block (token-list conversion included). ``hash_path`` in the JSON says whether the C extension
(``cpd.kv._chain_sha256``) or the pure-Python loop hashed, ``index_walk`` whether the index's
prefix walk ran in C (``cpd.router._mask_walk``) or numpy, ``prefix_cache`` the C path's
prefix-cache counters.

Usage::

    .venv/bin/python benchmarks/bench_router.py [--lengths 2048,32768,131072] [--reps 30]
        [--indexed-blocks 1000000] [--breakdown] [--hash-micro] [--pure-python] [--no-prefix-cache]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from cpd.kv import block_hash
from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.kv.events import MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, BlockStored, KVEventBatch
from cpd.policy.routing import LinearCostModel, RoutingConfig, WorkerLoad, route
from cpd.router import mask_table
from cpd.router.index import PrefixIndex

HASH_PATH = "C extension" if block_hash._chain_native is not None else "pure Python"
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


def decide_parts_ms(idx: PrefixIndex, tokens: list[int], loads, cfg, cost) -> tuple[float, float, float]:
    """:func:`decide` timed part by part: (hash, match, route) milliseconds."""
    t0 = time.perf_counter()
    hs = hash_blocks(tokens, NS)
    t1 = time.perf_counter()
    m = idx.match(hs, l3_max_blocks=(len(tokens) - 1) // BS)
    t2 = time.perf_counter()
    route(len(tokens), m, loads, cfg, cost)
    t3 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3


def _seed_l3(idx: PrefixIndex, tokens: list[int]) -> None:
    """Put the prompt's blocks in L3 only, in 16-block chunks (a write-through)."""
    hs = hash_blocks(tokens, NS)
    idx.apply_batch("pp", 10**9 + len(tokens), KVEventBatch(ts=0, events=[
        _stored(hs[i:i + 16], MEDIUM_L3) for i in range(0, len(hs) - 15, 16)]))


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
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hash-micro", action="store_true",
                    help="also time the hashing pieces alone (Python vs C chain, list -> bytes conversions)")
    ap.add_argument("--pure-python", action="store_true",
                    help="hash with the pure-Python loop even where the C extension is built (the 'before')")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="the C hash path hashes every prompt whole (no prefix cache)")
    a = ap.parse_args()
    if a.no_prefix_cache:
        block_hash.PREFIX_CACHE = False
    global HASH_PATH
    if a.pure_python:
        block_hash._chain_native = block_hash._u32le_native = None
        HASH_PATH = "pure Python"
    rng = random.Random(0)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    idx = build_index(a.indexed_blocks, rng)
    print(f"block hashing: {HASH_PATH}")
    print(f"index built in {time.perf_counter() - t0:.1f} s: {idx.sizes()}")
    loads = [WorkerLoad(w, "pre-prefill" if i % 2 else "prefill") for i, w in enumerate(WORKERS)] + [
        WorkerLoad("d0", "decode")]
    cfg, cost = RoutingConfig(block_size=BS), LinearCostModel(kv_bytes_per_token=18432)
    out: dict[str, dict] = {}
    for n in [int(x) for x in a.lengths.split(",")]:
        cold_ms, grown_ms, cold_cpu_ms, grown_cpu_ms = [], [], [], []
        l3_ms, l3_cpu_ms = [], []
        parts: list[tuple[float, float, float]] = []
        grown_parts: list[tuple[float, float, float]] = []
        l3_parts: list[tuple[float, float, float]] = []
        session = [rng.randrange(50000) for _ in range(n - 256)]
        _seed_prompt(idx, session)
        decide(idx, session, loads, cfg, cost)
        session_l3 = [rng.randrange(50000) for _ in range(n - 256)]
        _seed_l3(idx, session_l3)
        for _ in range(a.reps):
            cold = [rng.randrange(50000) for _ in range(n)]
            t, tc = time.perf_counter(), time.process_time()
            decide(idx, cold, loads, cfg, cost)
            cold_ms.append((time.perf_counter() - t) * 1e3)
            cold_cpu_ms.append((time.process_time() - tc) * 1e3)
            grown = session + [rng.randrange(50000) for _ in range(256)]
            t, tc = time.perf_counter(), time.process_time()
            d = decide(idx, grown, loads, cfg, cost)
            grown_ms.append((time.perf_counter() - t) * 1e3)
            grown_cpu_ms.append((time.process_time() - tc) * 1e3)
            grown3 = session_l3 + [rng.randrange(50000) for _ in range(256)]
            t, tc = time.perf_counter(), time.process_time()
            d3 = decide(idx, grown3, loads, cfg, cost)
            l3_ms.append((time.perf_counter() - t) * 1e3)
            l3_cpu_ms.append((time.process_time() - tc) * 1e3)
            if a.breakdown:
                parts.append(decide_parts_ms(idx, [rng.randrange(50000) for _ in range(n)], loads, cfg, cost))
                grown_parts.append(decide_parts_ms(idx, session + [rng.randrange(50000) for _ in range(256)],
                                                   loads, cfg, cost))
                l3_parts.append(decide_parts_ms(idx, session_l3 + [rng.randrange(50000) for _ in range(256)],
                                                loads, cfg, cost))
        assert d.load_plan.l1_blocks > 0 and d.load_plan.l2_blocks > 0, d
        m3 = idx.match(hash_blocks(grown3, NS), l3_max_blocks=(len(grown3) - 1) // BS)
        assert m3.l3 >= (len(session_l3) // BS) // 16 * 16 and not m3.l1 and not m3.l2, (m3, d3)
        out[str(n)] = {k: {"p50_ms": statistics.median(v), "p99_ms": _p99(v)}
                       for k, v in (("cold", cold_ms), ("grown", grown_ms), ("grown_l3", l3_ms))}
        for k, v in (("cold", cold_cpu_ms), ("grown", grown_cpu_ms), ("grown_l3", l3_cpu_ms)):
            out[str(n)][k].update(cpu_p50_ms=statistics.median(v), cpu_p99_ms=_p99(v))
        print(f"{n:>7} tokens: cold p50 {out[str(n)]['cold']['p50_ms']:.2f} ms p99 {out[str(n)]['cold']['p99_ms']:.2f}"
              f" ms | grown p50 {out[str(n)]['grown']['p50_ms']:.2f} ms p99 {out[str(n)]['grown']['p99_ms']:.2f} ms"
              f" | CPU p50/p99 cold {out[str(n)]['cold']['cpu_p50_ms']:.2f}/{out[str(n)]['cold']['cpu_p99_ms']:.2f}"
              f" grown {out[str(n)]['grown']['cpu_p50_ms']:.2f}/{out[str(n)]['grown']['cpu_p99_ms']:.2f}"
              f" grown_l3 {out[str(n)]['grown_l3']['cpu_p50_ms']:.2f}/{out[str(n)]['grown_l3']['cpu_p99_ms']:.2f}"
              " ms", flush=True)
        for case, ps in (("cold", parts), ("grown", grown_parts), ("grown_l3", l3_parts)):
            if not ps:
                continue
            names = ("hash", "match", "route")
            bd = {k: {"p50_ms": statistics.median(v), "p99_ms": _p99(list(v))} for k, v in zip(names, zip(*ps))}
            bd["hash"]["us_per_block"] = bd["hash"]["p50_ms"] * 1e3 / (n // BS)
            out[str(n)][f"{case}_parts"] = bd
            print(f"         {case} parts p50: " + ", ".join(f"{k} {bd[k]['p50_ms']:.2f} ms" for k in names)
                  + f" ({bd['hash']['us_per_block']:.2f} us/block hashed)", flush=True)
    micro = hash_micro([int(x) for x in a.lengths.split(",")], 15, rng) if a.hash_micro else None
    if a.json:
        with open(a.json, "w") as f:
            walk = "C extension" if mask_table._walk_native is not None else "numpy"
            cache = block_hash._PREFIXES
            json.dump({"router_decision": out, "hash_micro_ms": micro, "indexed_blocks": idx.sizes(), "hash_path": HASH_PATH,
                       "index_walk": walk, "prefix_cache": {"on": block_hash.PREFIX_CACHE, "hits": cache.hits,
                                                            "misses": cache.misses, "entries": len(cache),
                                                            "bytes": cache.nbytes},
                       "loadavg_start": load0, "loadavg_end": os.getloadavg()}, f, indent=1)


def hash_micro(lengths: list[int], reps: int, rng: random.Random) -> dict[str, dict[str, float]]:
    """Best-of-``reps`` ms of the hashing pieces per prompt length: the chained loop in Python
    (``_chain_py``) and in C, and the token list → ``u32le`` bytes conversions."""
    import array

    import numpy as np

    def best_ms(f) -> float:
        b = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            f()
            b = min(b, time.perf_counter() - t)
        return b * 1e3

    out: dict[str, dict[str, float]] = {}
    for n in lengths:
        toks = [rng.randrange(50000) for _ in range(n)]
        buf, parent, step = array.array("I", toks).tobytes(), (1).to_bytes(8, "big"), 4 * BS
        r = {"chain_python": best_ms(lambda: block_hash._chain_py(parent, buf, 0, len(buf), step)),
             "array_tobytes": best_ms(lambda: array.array("I", toks).tobytes()),
             "numpy_asarray": best_ms(lambda: np.asarray(toks, dtype=np.uint32).tobytes())}
        if block_hash._chain_native is not None and block_hash._u32le_native is not None:
            chain_c, u32le_c = block_hash._chain_native, block_hash._u32le_native
            assert chain_c(parent, buf, 0, len(buf), step) == block_hash._chain_py(parent, buf, 0, len(buf), step)
            r["chain_c"] = best_ms(lambda: chain_c(parent, buf, 0, len(buf), step))
            r["u32le_c"] = best_ms(lambda: u32le_c(toks))
        for k in ("chain_python", "chain_c"):
            if k in r:
                r[k.replace("chain", "ns_per_block")] = r[k] * 1e6 / (n // BS)
        out[str(n)] = r
        print(f"{n:>7} tokens, hashing pieces (best of {reps}): " + ", ".join(
            f"{k} {v:.3f}" + ("" if k.startswith("ns_") else " ms") for k, v in r.items()), flush=True)
    return out


def _p99(v: list[float]) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


if __name__ == "__main__":
    main()
