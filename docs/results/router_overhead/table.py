"""Print the before/after tables of README.md from a ``bench_router_request.py --json`` result.

Usage: python table.py result.json"""
from __future__ import annotations

import json
import sys

ROWS = [("body_read", "body read"), ("json_parse", "JSON parse + checks"), ("validate", "validation"),
        ("tokenize", "chat template + tokenize"), ("hash", "block hashing"), ("match_route", "index match + route"),
        ("prefill_encode", "prefill request JSON"), ("prefill_decode", "prefill answer decode"),
        ("l3_observe", "L3 observations applied"), ("pending_writes", "pending L3 writes"),
        ("decode_encode", "decode request JSON"), ("decode_lines", "decode lines decode"),
        ("detokenize", "detokenize"), ("response", "response JSON"),
        ("router_own", "**router's own wall time**"), ("router_cpu", "router process CPU"),
        ("events_cpu", "of which KV-event thread"), ("router_cpu_no_events", "router CPU without events"),
        ("worker_prefill", "prefill worker's own time"), ("prefill_wait", "prefill call (worker + HTTP)"),
        ("decode_wait", "decode call (worker + HTTP)"), ("client_wall", "client wall time")]


def main(path: str) -> None:
    d = json.load(open(path))
    m = d["medians_ms"]
    variants = list(m)
    for api in d["apis"]:
        lengths = [str(n) for n in d["lengths"]]
        head = "| stage (ms, median) | " + " | ".join(
            f"{n} {v}" for n in lengths for v in variants) + " |"
        print(f"\n**{api}** (prompt tokens: " + ", ".join(
            f"{m[variants[0]][api][n]['prompt_tokens']}" for n in lengths) + ")\n")
        print(head)
        print("|---|" + "---:|" * (len(lengths) * len(variants)))
        for key, label in ROWS:
            cells = [f"{m[v][api][n].get(key, 0.0):.1f}" for n in lengths for v in variants]
            print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nload average (1, 5, 15 min) before: {[round(x, 2) for x in d['load_avg_before']]}, "
          f"after: {[round(x, 2) for x in d['load_avg_after']]}; reps {d['reps']}, time dilation {d['time_dilation']}")


if __name__ == "__main__":
    main(sys.argv[1])
