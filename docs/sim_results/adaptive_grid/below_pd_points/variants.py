"""Variants of rule A3's SLO test (cpd/policy/routing.py, _choose_prefill_side / _spill_margin) on the
modeled-ordering workload, adaptive cpd only; tried before the change, kept for the record. Run from a
snapshot root of the tree BEFORE the change:

    PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/below_pd_points/variants.py \
        VARIANT [--seeds 1,...,10] [--points 3,4.5,6] [--out FILE.json]

VARIANT: ``base`` (the tree as is); ``heavyF`` (heavy work stays home unconditionally only while the home
pool's best predicts at most F x ttft_slo_s; F = m means 1 - spill_margin); ``bothF`` (the same bound also
for short work's margin: short work pays it only while home predicts at most F x ttft_slo_s; ``bothm`` was
f411987, replaced by ``heavym``, the rule adopted, SLO_PREDICTION_SHARE = 0.75); ``allF`` (``bothF`` and heavy work also spills without the
margin once home predicts more than F x ttft_slo_s).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")
import benchmarks.modeled_ordering as mo  # noqa: E402
import cpd.policy.routing as R  # noqa: E402
from cpd.engine.weights import make_tiny_llama_dir  # noqa: E402
from cpd.types import Role, Topology  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("variant")
p.add_argument("--seeds", default="1,2,3,4,5,6,7,8,9,10")
p.add_argument("--points", default="3,4.5,6")
p.add_argument("--out", default="")
x = p.parse_args()
v = x.variant


def _factor(cfg, s):
    return 1.0 - cfg.spill_margin if s == "m" else float(s)


def choose(cands, heavy, cfg):
    """_choose_prefill_side with the heavy stay-home bound at F x SLO."""
    f = _factor(cfg, v[5:] if v.startswith("heavy") else v[3:] if v.startswith("all") else v[4:])
    home_role = Role.PRE_PREFILL if heavy and cfg.topology == Topology.CPD else Role.PREFILL
    home = [c for c in cands if c.load.role == home_role]
    other = [c for c in cands if c.load.role != home_role]
    if not home:
        return R._best(other), R.DecisionReason.FALLBACK, home_role
    best_home = R._best(home)
    if cfg.topology != Topology.CPD or not other:
        return best_home, R.DecisionReason.HOME, None
    if heavy:
        if best_home.est.ttft_s <= f * cfg.ttft_slo_s:
            return best_home, R.DecisionReason.HOME, None
        other = [c for c in other if R._short_work_still_fits(c, other, best_home.est.wait_s, cfg)]
    if other:
        best_other = R._best(other)
        margin = cfg.spill_margin
        if not heavy and best_home.est.ttft_s > (f if v.startswith(("both", "all")) else 1.0) * cfg.ttft_slo_s:
            margin = 0.0
        if heavy and v.startswith("all"):
            margin = 0.0
        if best_other.est.ttft_s < (1.0 - margin) * best_home.est.ttft_s:
            return best_other, (R.DecisionReason.SPILL_COLD if heavy else R.DecisionReason.SPILL_WARM), None
    return best_home, R.DecisionReason.HOME, None


if v != "base":
    R._choose_prefill_side = choose
md = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "m", seed=0))
vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
res = {}
for s in x.seeds.split(","):
    a = mo.parse_args(["--sim-only", "--seed", s])
    for q in x.points.split(","):
        sm = mo.summarise(mo.run_sim(a, "cpd", mo.workload(a, float(q)), vocab, md), a, a.duration / 4)
        res[f"{s}|{q}|cpd"] = {"goodput": sm["goodput"], "ttft_p90": sm["ttft_s"]["p90"], "requests": sm["requests"],
                               "pool_share": sm["pool_share"]}
print(v, "summed goodput", round(sum(r["goodput"] for r in res.values()), 4))
if x.out:
    Path(x.out).write_text(json.dumps({"res": res}, indent=1))
