"""Table of a probe (adaptive cpd alone) against session 19's one-commit grid: best other and grid cpd per seed.
python docs/sim_results/adaptive_grid/session20/probe_table.py PROBE.jsonl > TABLE.md"""
import glob, json, os, sys

HERE = os.path.dirname(os.path.abspath(__file__))
grid = {}
for f in glob.glob(os.path.join(HERE, "..", "session19", "agent", "cells", "*.json")):
    d = json.load(open(f)); c, r = d["cell"], d["result"]
    for i, s in enumerate(r["seeds"]):
        sat = {k: v["per_seed"][i] for k, v in r["saturation"].items()}
        best = max(v for k, v in sat.items() if k != "cpd")
        grid[f"{c['cold']}:{float(c['ttft_s'])}:{c['output']}:{s}"] = (best, sat["cpd"])
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| cell (cold:TTFT:output:seed) | best other (grid) | cpd (grid) | ratio | cpd (probe) | ratio |")
print("|---|---:|---:|---:|---:|---:|")
worst = []
for r in sorted(rows, key=lambda r: r["spec"]):
    cold, ttft, o, s = r["spec"].split(":")
    best, old = grid[f"{float(cold)}:{float(ttft)}:{o}:{s}"]
    f = lambda x: f"{x / best:.3f}" if best > 0 else "—"
    print(f"| {r['spec']} | {best:.4f} | {old:.4f} | {f(old)} | {r['sat']:.4f} | {f(r['sat'])} |")
    if best > 0:
        worst.append((r["sat"] / best, old / best))
print(f"\n{len(worst)} seeds with a ratio: below 0.97 in the grid {sum(o < 0.97 for _, o in worst)}, "
      f"in the probe {sum(n < 0.97 for n, _ in worst)}; probe higher on {sum(n > o for n, o in worst)}, "
      f"lower on {sum(n < o for n, o in worst)}")
