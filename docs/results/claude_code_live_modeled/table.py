"""Table of benchmarks/claude_code_live_modeled.py results: live vs simulator per configuration and load,
the live runs' load average and the router's own time per request (from the kept /cpd/requests records).

    python docs/results/claude_code_live_modeled/table.py RESULT.json[@PREFIX] ... --records DIR

Records are read from ``DIR/<PREFIX><n>req-*-<config>.jsonl[.gz]`` (n: the point's request count).
"""
import gzip
import argparse
import json
import statistics
from pathlib import Path


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def router_time(records_dir: Path, prefix: str, n_req: int, name: str, k: float, warm_s: float):
    """Router-side time per request (ttft_s - worker_prefill_s, modeled s) over the window's requests."""
    cands = sorted(records_dir.glob(f"{prefix}{n_req}req-*-{name}.jsonl*"))
    if not cands:
        return None
    opener = gzip.open if cands[0].suffix == ".gz" else open
    with opener(cands[0], "rt") as fh:
        rows = [json.loads(line) for line in fh]
    ov = [(r["record"]["ttft_s"] - r["record"]["worker_prefill_s"]) / k for r in rows
          if r["arrival_s"] >= warm_s and r.get("record") and r["record"].get("worker_prefill_s") is not None
          and r["record"].get("ttft_s") is not None]
    lag = [r["send_lag_s"] / k for r in rows if r.get("send_lag_s") is not None]
    return {"p50": pct(ov, .5), "p90": pct(ov, .9), "max": max(ov) if ov else None, "send_lag_p90": pct(lag, .9)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--records", default="")
    a = ap.parse_args()
    lines = ["| load (nominal QPS/GPU; total) | requests in window | config | goodput live / sim / mirror | "
             "TTFT p50 live / sim (s) | TTFT p90 live / sim (s) | TPOT p90 live / sim (ms) | "
             "pre-prefill share live / sim | router time p50 / p90 / max (s) | load 1m min / median / max |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    orders = []
    for arg in a.results:
        path, _, prefix = arg.partition("@")
        res = json.loads(Path(path).read_text())
        k = res["args"]["time_dilation"]
        gpus = res.get("claude_code", {}).get("num_gpus", 12)
        for pt in res["points"]:
            for name, c in pt["configs"].items():
                s, lv, m = c["sim"], c.get("live"), c.get("mirror")
                rt = router_time(Path(a.records), prefix, pt["num_requests"], name, k, pt["warm_s"]) if a.records else None
                ls = (c.get("live_run") or {}).get("load_1m_samples") or []
                ld = f"{min(ls):.2f} / {statistics.median(ls):.2f} / {max(ls):.2f}" if ls else "-"
                pp = lambda d: f((d or {}).get("pool_share", {}).get("pre-prefill", 0.0), 2) if d else "-"
                lines.append(
                    f"| {pt['qps'] / gpus:g}; {pt['qps']:g} | {pt['window_requests']} | {name} | "
                    f"**{f(lv and lv['goodput'])}** / {f(s['goodput'])} / {f(m and m['goodput'])} | "
                    f"{f(lv and lv['ttft_s']['p50'])} / {f(s['ttft_s']['p50'])} | "
                    f"{f(lv and lv['ttft_s']['p90'])} / {f(s['ttft_s']['p90'])} | "
                    f"{f(lv and lv['tpot_s']['p90'] * 1e3, 1)} / {f(s['tpot_s']['p90'] * 1e3, 1)} | "
                    f"{pp(lv)} / {pp(s)} | "
                    + (f"{f(rt['p50'])} / {f(rt['p90'])} / {f(rt['max'])}" if rt else "-") + f" | {ld} |")
            o = pt["ordering"]
            orders.append(f"- {pt['qps'] / gpus:g} QPS/GPU: sim {' > '.join(o['sim_ranked'])}; live "
                          f"{' > '.join(o.get('live_ranked', []))}; mirror {' > '.join(o.get('mirror_ranked', []))}; "
                          f"pairs sim vs live: {json.dumps(o.get('agreement', {}))}; "
                          f"mirror vs live: {json.dumps(o.get('agreement_mirror', {}))}; "
                          f"relations sim {json.dumps(o['sim_relations'])} live {json.dumps(o.get('live_relations', {}))}")
    print("\n".join(lines))
    print()
    print("\n".join(orders))


if __name__ == "__main__":
    main()
