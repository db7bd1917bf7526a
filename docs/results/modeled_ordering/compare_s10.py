"""Session 10 rerun vs the session 8 run and the simulator (docs/results/modeled_ordering/README.md).

    python3 docs/results/modeled_ordering/compare_s10.py NEW.json OLD.json [RECORDS_DIR]

Prints markdown: per point and configuration, goodput and TTFT p50/p90 for sim / live (session 8) /
live (now); the pair relations on each side and how the new live side compares with the simulator;
and, from the kept ``/cpd/requests`` records (benchmarks/modeled_ordering_records.py), each live
run's TTFT split into the prefill worker's queue (``worker_queue_s``), its compute
(``worker_compute_s``) and the time outside the worker's call (``ttft_s - worker_prefill_s``:
routing, read-after-write hold, HTTP, handoff), over the measured window, in modeled seconds (/K).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

LABEL = {"cpd": "cpd-adaptive"}


def sym(v: int | None) -> str:
    return "-" if v is None else ">" if v > 0 else "<" if v < 0 else "≈"


def verdict(s: int, l_: int) -> str:
    return "same" if s == l_ else "reversed" if s * l_ < 0 else "tie on one side"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def f(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def main() -> None:
    new = json.loads(Path(sys.argv[1]).read_text())
    old = json.loads(Path(sys.argv[2]).read_text())
    rec_dir = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    k = new["args"]["time_dilation"]
    olds = {p["qps"]: p for p in old["points"]}
    tot = {"same": 0, "tie on one side": 0, "reversed": 0}
    tot_old = dict(tot)
    for pt in new["points"]:
        q = pt["qps"]
        op = olds.get(q)
        print(f"\n#### {q:g} QPS ({pt['window_requests']} measured requests)\n")
        print("| config | goodput sim / live s8 / live now | TTFT p50 sim / s8 / now (s) | TTFT p90 sim / s8 / now (s)"
              " | live load 1m start-end |")
        print("|---|---|---|---|---|")
        for name, c in pt["configs"].items():
            oc = (op or {}).get("configs", {}).get(name, {})
            ol = oc.get("live") or {}
            lv = c.get("live") or {}
            run = c.get("live_run") or {}
            print(f"| {LABEL.get(name, name)} | {f(c['sim']['goodput'])} / {f(ol.get('goodput'))} / "
                  f"**{f(lv.get('goodput'))}** | {f(c['sim']['ttft_s']['p50'])} / {f((ol.get('ttft_s') or {}).get('p50'))} / "
                  f"{f((lv.get('ttft_s') or {}).get('p50'))} | {f(c['sim']['ttft_s']['p90'])} / "
                  f"{f((ol.get('ttft_s') or {}).get('p90'))} / {f((lv.get('ttft_s') or {}).get('p90'))} | "
                  f"{f(run.get('load_1m_start'))}-{f(run.get('load_1m_end'))} |")
        o = pt["ordering"]
        oo = (op or {}).get("ordering", {})
        print("\n| pair | sim | live s8 | live now | now vs sim |")
        print("|---|---|---|---|---|")
        for p, s in o["sim_relations"].items():
            x, y = p.split("|")
            lnow = o.get("live_relations", {}).get(p)
            lold = oo.get("live_relations", {}).get(p)
            v = verdict(s, lnow) if lnow is not None else "-"
            if lnow is not None:
                tot[v] += 1
            if lold is not None:
                tot_old[verdict(oo["sim_relations"][p], lold)] += 1
            print(f"| {LABEL.get(x, x)} vs {LABEL.get(y, y)} | {sym(s)} | {sym(lold)} | {sym(lnow)} | {v} |")
        print(f"\n- sim order: {' > '.join(LABEL.get(n, n) for n in o['sim_ranked'])}; live order now: "
              f"{' > '.join(LABEL.get(n, n) for n in o.get('live_ranked', []))}")
    print(f"\nTotal now vs sim: {tot}; session 8 vs its sim: {tot_old}")
    if rec_dir is None:
        return
    print("\n#### Live TTFT split (measured window, modeled s = wall / K; means, p90 of TTFT)\n")
    print("| point | config | n | TTFT mean | TTFT p90 | queue mean | compute mean | outside mean | outside p90 |"
          " outside max | outside sum |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for pt in new["points"]:
        warm = pt["warm_s"]
        for name in pt["configs"]:
            paths = sorted(rec_dir.glob(f"{pt['num_requests']}req-*-{name}.jsonl"))
            if not paths:
                continue
            rows = [json.loads(x) for x in paths[0].read_text().splitlines()]
            rs = [r["record"] for r in rows if r["arrival_s"] >= warm and r.get("record")
                  and r["record"].get("ttft_s") is not None and r["record"].get("worker_prefill_s") is not None]
            tt = [r["ttft_s"] / k for r in rs]
            qu = [r["worker_queue_s"] / k for r in rs]
            co = [r["worker_compute_s"] / k for r in rs]
            out = [(r["ttft_s"] - r["worker_prefill_s"]) / k for r in rs]
            n = len(rs) or 1
            print(f"| {pt['qps']:g} | {LABEL.get(name, name)} | {len(rs)} | {f(sum(tt) / n)} | {f(pct(tt, .9))} | "
                  f"{f(sum(qu) / n)} | {f(sum(co) / n)} | {f(sum(out) / n, 3)} | {f(pct(out, .9), 3)} | "
                  f"{f(max(out) if out else None, 3)} | {f(sum(out), 1)} |")


if __name__ == "__main__":
    main()
