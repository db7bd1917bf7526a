"""Simulator goodput of the modeled-ordering workload (benchmarks/modeled_ordering.py --sim-only) over
several seeds, one line per seed and point; run from the repository root:

    PYTHONPATH=. nice -n 10 .venv/bin/python docs/sim_results/adaptive_grid/spill_past_slo/mo_seeds.py \
        --seeds 1,2,3,4,5,6,7,8,9,10 --configs pd,pd-l3,cpd-static,cpd --out /tmp/mo.json
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, '.')
import benchmarks.modeled_ordering as mo  # noqa: E402
from cpd.engine.weights import make_tiny_llama_dir  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument('--seeds', default='1,2,3,4,5')
p.add_argument('--points', default='3,4.5,6')
p.add_argument('--configs', default='pd-l3,cpd')
p.add_argument('--out', default='')
x = p.parse_args()
model_dir = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / 'm', seed=0))
vocab = json.loads((Path(model_dir) / 'config.json').read_text())['vocab_size']
res = {}
for s in x.seeds.split(','):
    a = mo.parse_args(['--sim-only', '--seed', s])
    for q in x.points.split(','):
        reqs = mo.workload(a, float(q))
        line = []
        for name in x.configs.split(','):
            sm = mo.summarise(mo.run_sim(a, name, reqs, vocab, model_dir), a, a.duration / 4)
            res[f"{s}|{q}|{name}"] = {"goodput": sm["goodput"], "ttft_p90": sm["ttft_s"]["p90"],
                                     "requests": sm["requests"], "hit_L3": sm["hit_ratio"]["L3"],
                                     "pool_share": sm["pool_share"]}
            line.append(f"{name}={sm['goodput']:.3f}/{sm['ttft_s']['p90']:.2f}")
        print(f"seed {s} qps {q}: " + "  ".join(line), flush=True)
if x.out:
    Path(x.out).write_text(json.dumps({"res": res}, indent=1))
