"""Simulator-only results against the recorded live runs: goodput, TTFT p90 and the pairwise order
(benchmarks/modeled_ordering.py's rule) per load, for any number of simulator result files.

    cd /work/main && PYTHONPATH=. .venv/bin/python docs/results/claude_code_live_modeled/compare_sim_live.py \
        LIVE.json SIM_A.json[@label] [SIM_B.json[@label] ...]

``LIVE.json``: a result with live sides (e.g. result_load3.json); each ``SIM`` file: a ``--sim-only``
result of the same point(s). Prints a markdown table and the agreement per file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import benchmarks.modeled_ordering as mo  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    args = (argv if argv is not None else sys.argv[1:])
    live = json.loads(Path(args[0]).read_text())
    a = argparse.Namespace(goodput_tol=live["args"]["goodput_tol"], ttft_tol=live["args"]["ttft_tol"])
    sims = []
    for s in args[1:]:
        path, _, label = s.partition("@")
        sims.append((label or Path(path).stem, json.loads(Path(path).read_text())))
    for lp in live["points"]:
        names = list(lp["configs"])
        live_s = {n: lp["configs"][n]["live"] for n in names}
        _, live_rel = mo.ordering(live_s, a)
        print(f"\n### {lp['qps']:g} QPS total, {lp['window_requests']} requests in the window\n")
        head = ["config", "live"] + [lab for lab, _ in sims]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        rows: dict[str, list[str]] = {n: [f"{live_s[n]['goodput']:.3f} ({live_s[n]['ttft_s']['p90']:.2f})"]
                                      for n in names}
        verdicts = []
        for lab, res in sims:
            sp = next(p for p in res["points"] if p["qps"] == lp["qps"])
            summ = {n: sp["configs"][n]["sim"] for n in names}
            for n in names:
                rows[n].append(f"{summ[n]['goodput']:.3f} ({summ[n]['ttft_s']['p90']:.2f})")
            ranked, rel = mo.ordering(summ, a)
            ag = mo.compare(rel, live_rel)
            verdicts.append(f"- {lab}: order {' > '.join(ranked)}; agree {ag['agree']}, soft {ag['soft']}, "
                            f"disagree {ag['disagree']}")
        for n in names:
            print(f"| {n} | " + " | ".join(rows[n]) + " |")
        print(f"\n- live: order {' > '.join(mo.ordering(live_s, a)[0])}")
        print("\n".join(verdicts))


if __name__ == "__main__":
    main()
