"""Issue 13, session 9: how much of a prefill step is linears on each side, same process, interleaved
(cpd engine step vs transformers forward with logits_to_keep=1, float32, 1 thread): thread CPU ms of the
whole step and of the linears inside it (cpd: the layers' and logits' _mm; transformers: nn.Linear.forward),
median over REPS after a warm-up. Usage: PYTHONPATH=. python linear_share.py LEN REPS"""
import statistics, sys, time

import torch
from torch import nn

torch.set_num_threads(1)
import cpd.engine.model as M  # noqa: E402
from benchmarks.bench_engine import CpdSide, HfSide, _prompts  # noqa: E402
from cpd.engine.weights import default_model_dir  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
md = default_model_dir()
acc = [0.0]
orig_mm = M._mm


def mm(*a, **k):
    t = time.thread_time()
    r = orig_mm(*a, **k)
    acc[0] += time.thread_time() - t
    return r


M._mm = mm
orig_lin = nn.Linear.forward


def lin(self, x):
    t = time.thread_time()
    r = orig_lin(self, x)
    acc[0] += time.thread_time() - t
    return r


nn.Linear.forward = lin  # cpd's model calls its weights through _mm, never nn.Linear.forward
sides = {"cpd": CpdSide(md, torch.float32, max(n, 512), 4), "hf": HfSide(md, torch.float32)}
res = {k: [] for k in sides}
for r in range(reps + 1):
    for k, s in sides.items():
        acc[0] = 0.0
        t = time.thread_time()
        s.prefill_s(_prompts(300 + r, 1, n, 49152))
        if r:
            res[k].append(((time.thread_time() - t) * 1e3, acc[0] * 1e3))
for k, v in res.items():
    step, li = statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)
    rest = statistics.median(x[0] - x[1] for x in v)
    print(f"{k}: step {step:.1f} ms, linears {li:.1f} ms, rest {rest:.1f} ms (medians of {reps})", flush=True)
rat = [h[0] / c[0] for c, h in zip(res["cpd"], res["hf"])]
lr = [h[1] / c[1] for c, h in zip(res["cpd"], res["hf"])]
print(f"step ratio hf/cpd med {statistics.median(rat):.3f} [{min(rat):.3f}-{max(rat):.3f}]; linears ratio med "
      f"{statistics.median(lr):.3f} [{min(lr):.3f}-{max(lr):.3f}]; load {__import__('os').getloadavg()}")
