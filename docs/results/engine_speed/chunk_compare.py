"""Chunked prefill (2048 in 512-token chunks) vs one step, cpd only, rows (seq_kv) on vs off, CPU
and wall time, interleaved. Run from the repository root: .venv/bin/python docs/results/engine_speed/chunk_compare.py"""
import sys, statistics, time, os
sys.path.insert(0, "benchmarks")
import torch
from bench_engine import CpdSide, _prompts, _med
from cpd.engine.dtype import resolve_dtype
from cpd.engine.weights import default_model_dir
torch.set_num_threads(1)
n, chunk = 2048, 512
md, dt = default_model_dir(), resolve_dtype("auto")
one = CpdSide(md, dt, 4096, 1)
ch = CpdSide(md, dt, 4096, 1, chunk_tokens=chunk)
res = {"one": [], "rows": [], "gather": []}
for r in range(5):
    ps = _prompts(5000 + r, 1, n, one.vocab)
    res["one"].append(one.prefill_s(ps))
    ch.set_rows(True); res["rows"].append(ch.prefill_s(ps))
    ch.set_rows(False); res["gather"].append(ch.prefill_s(ps))
for k, v in res.items():
    v = v[1:]
    print(k, f"wall {_med(v)*1e3:.0f} ms cpu {_med(v, True)*1e3:.0f} ms", [round(x[1]*1e3) for x in v])
print(os.getloadavg())
