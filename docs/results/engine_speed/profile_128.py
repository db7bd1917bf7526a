"""Issue 13, session 9: torch.profiler of a cpd engine prefill step vs transformers' forward
(logits_to_keep=1) at the same length, same process, float32, 1 thread; the ops' self CPU time summed
over REPS profiled repetitions (after 2 warm-ups each), side by side, plus each side's thread CPU ms
without the profiler (interleaved). cpd's OpenBLAS calls are not torch ops: they show as the gap
between the step and its ops (``(not an op)``). Usage: PYTHONPATH=. python profile_128.py LEN REPS"""
import statistics, sys, time

import torch
from torch.profiler import ProfilerActivity, profile

torch.set_num_threads(1)
from benchmarks.bench_engine import CpdSide, HfSide, _prompts  # noqa: E402
from cpd.engine.weights import default_model_dir  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
md = default_model_dir()
sides = {"cpd": CpdSide(md, torch.float32, max(n, 512), 4), "hf": HfSide(md, torch.float32)}
plain = {k: [] for k in sides}
for r in range(reps + 2):
    for k, s in sides.items():
        ps = _prompts(100 + r, 1, n, 49152)
        t = time.thread_time()
        s.prefill_s(ps)
        if r >= 2:
            plain[k].append((time.thread_time() - t) * 1e3)
print("thread CPU ms without profiler:", {k: [round(v, 1) for v in x] for k, x in plain.items()},
      "medians", {k: round(statistics.median(x), 1) for k, x in plain.items()}, flush=True)
tabs = {}
for k, s in sides.items():
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for r in range(reps):
            s.prefill_s(_prompts(200 + r, 1, n, 49152))
    tot = {}
    for e in prof.key_averages():
        tot[e.key] = (e.self_cpu_time_total / 1e3 / reps, e.count // reps)
    tabs[k] = tot
keys = sorted(set(tabs["cpd"]) | set(tabs["hf"]), key=lambda x: -max(tabs["cpd"].get(x, (0, 0))[0],
                                                                     tabs["hf"].get(x, (0, 0))[0]))
print(f"{'op':45s} {'cpd ms':>8s} {'calls':>6s} {'hf ms':>8s} {'calls':>6s}")
for key in keys[:40]:
    c, h = tabs["cpd"].get(key, (0, 0)), tabs["hf"].get(key, (0, 0))
    print(f"{key[:45]:45s} {c[0]:8.2f} {c[1]:6d} {h[0]:8.2f} {h[1]:6d}")
for k in tabs:
    print(k, "sum of ops' self ms per step", round(sum(v[0] for v in tabs[k].values()), 1))
