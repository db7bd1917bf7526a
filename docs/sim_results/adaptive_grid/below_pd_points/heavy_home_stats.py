"""Adaptive cpd on the modeled-ordering workload: how often a heavy request that rule A3 kept home
(home predicted within the SLO) missed the SLO, by its home prediction's share of the SLO, and what
the prefill pool's best offered then. Run from a snapshot root:

    PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/below_pd_points/heavy_home_stats.py \
        [--seeds 1,...,10] [--points 3,4.5,6] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tempfile

sys.path.insert(0, ".")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import analyse as an  # noqa: E402  (installs the recording simulator)
import benchmarks.modeled_ordering as mo  # noqa: E402
from cpd.engine.weights import make_tiny_llama_dir  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--seeds", default="1,2,3,4,5,6,7,8,9,10")
p.add_argument("--points", default="3,4.5,6")
p.add_argument("--out", default="")
x = p.parse_args()
md = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "m", seed=0))
vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
out = []
for s in x.seeds.split(","):
    a = mo.parse_args(["--sim-only", "--seed", s])
    for q in x.points.split(","):
        reqs = mo.workload(a, float(q))
        an._sims.clear()
        rows = mo.run_sim(a, "cpd", reqs, vocab, md)
        rec = an._sims[-1].rec
        for i, (r, row) in enumerate(zip(rec, rows)):
            if row["arrival_s"] < a.duration / 4 or "cands" not in r:
                continue
            home_role = "pre-prefill" if r["cls"] == "cold" else "prefill"
            home = min((v[2], v[0] + v[1]) for w, v in r["cands"].items() if w.startswith(home_role + "-"))
            oth = [v[0] + v[1] for w, v in r["cands"].items() if not w.startswith(home_role + "-")]
            out.append({"seed": int(s), "qps": float(q), "i": i, "cls": r["cls"], "reason": r["reason"],
                        "worker": r["worker"], "est": r["est_ttft"], "home_ttft": home[1],
                        "other_ttft": min(oth) if oth else None, "ttft": row["ttft_s"], "good": an.good(row, a)})
        print(f"seed {s} qps {q} done", flush=True)
slo = 2.0
print("heavy kept home (reason home, class cold), by home prediction / SLO:")
bands = [(0, .5), (.5, .75), (.75, .9), (.9, 1.0), (1.0, 99)]
for lo, hi in bands:
    sel = [o for o in out if o["cls"] == "cold" and o["reason"] == "home" and lo < o["home_ttft"] / slo <= hi]
    miss = [o for o in sel if not o["good"]]
    ratio = sorted(o["ttft"] / o["est"] for o in sel if o["ttft"] is not None)
    oth_half = [o for o in sel if o["other_ttft"] is not None and o["other_ttft"] < 0.75 * o["home_ttft"]]
    print(f"  ({lo:.2f}, {hi:.2f}]: {len(sel)} requests, {len(miss)} missed; actual/est median "
          f"{ratio[len(ratio) // 2] if ratio else float('nan'):.2f}; other pool < 0.75 x home: {len(oth_half)} "
          f"({sum(1 for o in oth_half if not o['good'])} of them missed)")
if x.out:
    Path(x.out).write_text(json.dumps(out))
