"""Issue 13, session 10: one decode batch (B sequences x C context) held by both sides in one process
(cpd engine steps vs transformers with a static cache, float32, 1 thread), STEPS decode steps
alternating between the sides (who goes first alternates; the first step of each side dropped):
thread CPU ms per step, median and per-pair ratio range; then torch.profiler over PROF more steps
per side, the ops' self CPU ms per step side by side (the profiler inflates small ops; read the op
list, not the sums). cpd's OpenBLAS linears are no torch op: they are the gap between the step and
its ops. Usage: PYTHONPATH=. python decode_profile.py B C STEPS PROF"""
import os, statistics, sys, time

import torch
from torch.profiler import ProfilerActivity, profile

torch.set_num_threads(1)
from benchmarks.bench_engine import CpdSide, HfSide, _prompts  # noqa: E402
from cpd.engine.weights import default_model_dir  # noqa: E402

B, C, steps, prof_steps = (int(x) for x in sys.argv[1:5])
md = default_model_dir()
sides = {"cpd": CpdSide(md, torch.float32, B * C, B), "hf": HfSide(md, torch.float32)}
ps = _prompts(7000 + C, B, C, 49152)
total = steps + prof_steps + 1
print("load at start", os.getloadavg(), flush=True)
t0 = time.time()
for s in sides.values():
    s.decode_begin(ps, total)
print(f"prefills {time.time() - t0:.0f} s", flush=True)
laps = {k: [] for k in sides}
for i in range(steps):
    order = ("cpd", "hf") if i % 2 == 0 else ("hf", "cpd")
    for k in order:
        t = time.thread_time()
        sides[k].decode_one()
        if i:
            laps[k].append((time.thread_time() - t) * 1e3)
rat = [h / c for c, h in zip(laps["cpd"], laps["hf"])]
print(f"{B}x{C}: cpd {statistics.median(laps['cpd']):.1f} ms [{min(laps['cpd']):.1f}-{max(laps['cpd']):.1f}], "
      f"hf {statistics.median(laps['hf']):.1f} ms [{min(laps['hf']):.1f}-{max(laps['hf']):.1f}], ratio "
      f"{statistics.median(laps['hf']) / statistics.median(laps['cpd']):.3f} per pair med {statistics.median(rat):.3f} "
      f"[{min(rat):.3f}-{max(rat):.3f}] over {len(rat)} pairs; load {os.getloadavg()}", flush=True)
tabs = {}
for k, s in sides.items():
    if not prof_steps:
        break
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(prof_steps):
            s.decode_one()
    tabs[k] = {e.key: (e.self_cpu_time_total / 1e3 / prof_steps, e.count // prof_steps) for e in prof.key_averages()}
if tabs:
    keys = sorted(set(tabs["cpd"]) | set(tabs["hf"]),
                  key=lambda x: -max(tabs["cpd"].get(x, (0, 0))[0], tabs["hf"].get(x, (0, 0))[0]))
    print(f"{'op':45s} {'cpd ms':>8s} {'calls':>6s} {'hf ms':>8s} {'calls':>6s}")
    for key in keys[:30]:
        c, h = tabs["cpd"].get(key, (0, 0)), tabs["hf"].get(key, (0, 0))
        print(f"{key[:45]:45s} {c[0]:8.2f} {c[1]:6d} {h[0]:8.2f} {h[1]:6d}")
for s in sides.values():
    s.decode_end()
