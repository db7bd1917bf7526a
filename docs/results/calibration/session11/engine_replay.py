"""Replay the predict_live_ttft slice (60 Mooncake requests from row START, time scale 0.1, spread
ticks) on one in-process torch Engine with the live worker's engine defaults (a pd prefill worker
without HTTP, router, handoff or other processes; max_tokens 1), arrivals on the engine's own wall
clock; print TTFT p50/p90, per-request TTFT, and the seq_kv arena's storage allocations and the
time spent in them. Usage (repo root, 1 torch thread):

    PYTHONPATH=. .venv/bin/python docs/results/calibration/session11/engine_replay.py [START]
"""
import random, sys, time
sys.path.insert(0, ".")
import torch
import benchmarks.predict_live_ttft as P
from cpd.config import Config
from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.engine.weights import default_model_dir
import cpd.engine.seq_kv as SK
torch.set_num_threads(1)
start = int(sys.argv[1]) if len(sys.argv) > 1 else 0
a = P.build_parser().parse_args(["--profile", "x", "--requests", "60", "--time-scale", "0.1", "--spread-ticks",
                                 "--start", str(start), "--out", "x"])
eng = Config().engine
bs = eng.block_size
reqs = P.trace_workload(P.read_mooncake(a.trace), P.replay_options(a), sim_block_tokens=bs)
sched = SchedulerConfig(max_num_batched_tokens=eng.max_num_batched_tokens, max_num_seqs=eng.max_num_seqs,
                        max_prefill_chunk_tokens=eng.max_prefill_chunk_tokens, block_size=bs)
e = Engine(default_model_dir(), num_blocks=eng.num_blocks, block_size=bs, scheduler_config=sched)
allocs = []
orig = SK.SeqKVArena._ensure
def ens(self, need_rows, need_tokens, bs_, kv):
    before = self.buf
    t = time.perf_counter(); ok = orig(self, need_rows, need_tokens, bs_, kv); dt = time.perf_counter() - t
    if self.buf is not before and self.buf is not None:
        allocs.append((tuple(self.buf.shape[2:5:2]), dt))
    return ok
SK.SeqKVArena._ensure = ens
def toks(r):
    out = []
    for b in r.blocks:
        g = random.Random(b); out += [g.randrange(10, e.vocab_size - 10) for _ in range(bs)]
    return out[:r.prompt_tokens]
warm = random.Random(0); e.add_request(EngineRequest("w", [warm.randrange(10, 1000) for _ in range(256)], SamplingParams(max_tokens=1)))
while e.has_unfinished(): e.step()
allocs.clear()
t0 = time.perf_counter(); c0 = time.process_time(); i = 0; ttft = {}
while i < len(reqs) or e.has_unfinished():
    now = time.perf_counter() - t0
    while i < len(reqs) and reqs[i].arrival_s <= now:
        e.add_request(EngineRequest(f"r{i}", toks(reqs[i]), SamplingParams(max_tokens=1, ignore_eos=True))); i += 1
    if not e.has_unfinished():
        time.sleep(max(0.0, reqs[i].arrival_s - now)); continue
    for o in e.step():
        if o.finished:
            k = int(o.request_id[1:]); ttft[k] = time.perf_counter() - t0 - reqs[k].arrival_s
cpu = time.process_time() - c0
v = sorted(ttft.values())
print(f"start {start}: TTFT p50 {v[len(v)//2]:.3f} p90 {v[int(0.9*len(v))]:.3f} mean {sum(v)/len(v):.3f}; CPU {cpu:.1f} s; "
      f"arena allocations {len(allocs)}, {sum(d for _, d in allocs):.2f} s; shapes {[s for s, _ in allocs][:30]}")
print("per request:", " ".join(f"{k}:{ttft[k]:.2f}" for k in sorted(ttft)[:20]))
