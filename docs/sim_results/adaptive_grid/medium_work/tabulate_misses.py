"""Tables of split_misses.py outputs (one or more JSON files): misses by kind and by routing, TTFT
percentiles by prompt class, decode batch sizes. ``python tabulate_misses.py A.json B.json ...``"""
import collections
import json
import sys


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def table(path: str) -> None:
    d = json.load(open(path))
    rows, s = d["rows"], d["summary"]
    print(f"== {d['config']} {d['qps_per_gpu']} QPS/GPU seed {d['seed']} heavy={d['heavy_uncached_s']}: "
          f"{len(rows)} requests, goodput {s['goodput']}, pool share {s['pool_share']}")
    mt = sum(r["miss_ttft"] for r in rows)
    mp = sum(r["miss_tpot"] for r in rows)
    both = sum(r["miss_ttft"] and r["miss_tpot"] for r in rows)
    print(f"  misses: TTFT {mt}, TPOT {mp}, both {both}, any {sum(r['miss_ttft'] or r['miss_tpot'] for r in rows)}")
    kind = lambda r: "compacted (<50K)" if r["prompt_tokens"] < 50_000 else ("cold" if r["cls"] == "cold" and r["own_s"] > 1 else "warm turn")
    groups = collections.defaultdict(list)
    for r in rows:
        groups[(kind(r), r["pool"], r["reason"])].append(r)
    for k, g in sorted(groups.items()):
        print(f"  {k}: n {len(g)}, TTFT miss {sum(r['miss_ttft'] for r in g)}, TPOT miss {sum(r['miss_tpot'] for r in g)}, "
              f"TTFT p90 {pct([r['ttft_s'] for r in g], .9):.2f}")
    for k in ("compacted (<50K)", "warm turn", "cold"):
        g = [r["ttft_s"] for r in rows if kind(r) == k]
        if g:
            print(f"  {k}: n {len(g)} TTFT p50 {pct(g, .5):.2f} p90 {pct(g, .9):.2f}")
    tp = [r["tpot_s"] for r in rows if r["tpot_s"]]
    print(f"  TPOT p50 {pct(tp, .5):.4f} p90 {pct(tp, .9):.4f}; TPOT misses arrived at "
          f"{sorted(r['arrival_s'] for r in rows if r['miss_tpot'])}")
    for wid, st in sorted(d["decode_steps"].items()):
        b = [x[2] for x in st]
        print(f"  {wid}: {len(st)} steps, batch mean {sum(b) / len(b):.1f} max {max(b)}, steps > 50 ms {sum(x[1] > .05 for x in st)}")


for p in sys.argv[1:]:
    table(p)
