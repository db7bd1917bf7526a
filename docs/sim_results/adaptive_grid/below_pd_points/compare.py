"""Adaptive cpd against the best P/D configuration per modeled-ordering point.

    python docs/sim_results/adaptive_grid/below_pd_points/compare.py PD_CONFIGS.json ADAPTIVE.json [...]

PD_CONFIGS.json: mo_seeds.py output holding pd, pd-l3, cpd-static (and cpd); each ADAPTIVE.json: a file whose
``cpd`` entries are compared (mo_seeds.py or variants.py output). Prints summed goodput per QPS and the
points where adaptive is below the best of pd / pd-l3 (and of pd / pd-l3 / cpd-static).
"""
import json
import sys

base = json.load(open(sys.argv[1]))["res"]
for f in sys.argv[2:]:
    ad = json.load(open(f))["res"]
    keys = sorted({k.rsplit("|", 1)[0] for k in ad}, key=lambda k: (float(k.split("|")[1]), int(k.split("|")[0])))
    per_q: dict = {}
    below, below3, above = [], [], 0
    for k in keys:
        g = ad[f"{k}|cpd"]["goodput"]
        bp = max(base[f"{k}|pd"]["goodput"], base[f"{k}|pd-l3"]["goodput"])
        b3 = max(bp, base[f"{k}|cpd-static"]["goodput"])
        per_q[k.split("|")[1]] = per_q.get(k.split("|")[1], 0.0) + g
        if g < bp - 1e-9:
            below.append(f"{k}: {g:.3f} vs {bp:.3f} ({g - bp:+.3f})")
        if g < b3 - 1e-9:
            below3.append(k)
        above += g > bp + 1e-9
    print(f"{f}: summed {sum(per_q.values()):.3f} (" + ", ".join(f"{q} QPS {v:.3f}" for q, v in per_q.items())
          + f"); below best pd/pd-l3 at {len(below)}, above at {above}; below best of 3 at {len(below3)}")
    for b in below:
        print("   ", b)
