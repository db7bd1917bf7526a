"""Session 11: the live workers' engine steps (step_log_s11/sitecustomize.py), per run and worker.

    python3 docs/results/modeled_ordering/steps_s11.py STEP_LOG_DIR LABEL1,LABEL2,... [K]

The step files (``<worker id>-<pid>.jsonl``) are grouped into runs by time (the runs of one
benchmark are sequential: a file whose first step starts after the current run's last step opens a run); LABELs name the runs in order (e.g. ``4.5:pd,4.5:pd-l3``).
Per run and prefill-side worker, in modeled seconds (wall / K):

- steps (that computed tokens), tokens, the summed step time and the modeled time waited in them
  (``busy``: forward + loads; step time - busy = the engine's own Python work inside its steps);
- the gaps between one step's return and the next step's call while the engine still had requests
  (waiting or running at the return): time the worker held work but ran no step;
- the span from the first step to the last.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    d = Path(sys.argv[1])
    labels = sys.argv[2].split(",")
    k = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
    files = []
    for p in d.glob("*.jsonl"):
        rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        if rows:
            files.append((rows[0]["t0"], p.stem.rsplit("-", 1)[0], rows))
    files.sort()
    runs: list[list] = []
    for f in files:  # a new run starts after every step of the current run has ended
        if not runs or f[0] > max(g[2][-1]["t1"] for g in runs[-1]):
            runs.append([])
        runs[-1].append(f)
    print("| run | worker | steps | tokens | step time (s) | modeled wait (s) | in-step overhead (s) | "
          "gaps with work (s) | gaps with work, per step (ms) | all gaps (s) | span (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, run in zip(labels + [f"run{i}" for i in range(len(labels), len(runs))], runs):
        for _, wid, rows in sorted(run, key=lambda f: f[1]):
            if wid.startswith("d"):
                continue
            st = [r for r in rows if r["tok"] > 0]
            step_s = sum(r["t1"] - r["t0"] for r in rows) / k
            busy = sum(r["busy"] for r in rows)
            gaps_work = sum(b["t0"] - a["t1"] for a, b in zip(rows, rows[1:]) if a["wait"] + a["run"] > 0) / k
            gaps_all = sum(b["t0"] - a["t1"] for a, b in zip(rows, rows[1:])) / k
            n_work = sum(1 for a in rows[:-1] if a["wait"] + a["run"] > 0) or 1
            print(f"| {label} | {wid} | {len(st)} | {sum(r['tok'] for r in rows)} | {step_s:.2f} | {busy:.2f} | "
                  f"{step_s - busy:.2f} | {gaps_work:.2f} | {gaps_work / n_work * 1000:.1f} | {gaps_all:.2f} | "
                  f"{(rows[-1]['t1'] - rows[0]['t0']) / k:.2f} |")


if __name__ == "__main__":
    main()
