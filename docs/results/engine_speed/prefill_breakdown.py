"""Issue 13, session 8: thread CPU time of a cpd prefill step split by wrapping the model's pieces
(linears, attention, RMSNorm, metadata). Usage: PYTHONPATH=. python prefill_breakdown.py LEN REPS"""
import sys, time, torch, statistics
torch.set_num_threads(1)

from benchmarks.bench_engine import CpdSide, _prompts
from cpd.engine.weights import default_model_dir
import cpd.engine.model as M
n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
side = CpdSide(default_model_dir(), torch.float32, 2048, 16)
acc = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.thread_time(); r = f(*a, **k); acc[key] = acc.get(key, 0) + time.thread_time() - t; return r
    setattr(obj, name, g)
ex = side.engine.executor
m = ex.model
wrap(m, 'forward', 'model.forward')
wrap(M, 'build_metadata', 'build_metadata')
import cpd.engine.executor_torch as ET
wrap(ET, 'build_metadata', 'build_metadata')
wrap(ex.seq_kv, 'plan', 'seq_kv.plan')
wrap(ex, 'forward', 'executor.forward')
for l in m.layers:
    big = l.big_linear
    def bl(*a, _b=big, **k):
        t = time.thread_time(); r = _b(*a, **k); acc['big_linear'] = acc.get('big_linear', 0) + time.thread_time() - t; return r
    l.big_linear = bl
    wrap(l, '_attend_per_seq', 'attend')
    wrap(l.input_layernorm, 'forward', 'rmsnorm')
    wrap(l.post_attention_layernorm, 'forward', 'rmsnorm')
M_mm = M._mm
tot = []
for r in range(reps + 1):
    acc.clear()
    ps = _prompts(1000 * r + n, 1, n, side.vocab)
    t = time.thread_time(); side.prefill_s(ps); dt = time.thread_time() - t
    if r:
        tot.append((dt, dict(acc)))
print('step total ms', [round(x[0] * 1e3, 1) for x in tot])
for k in tot[0][1]:
    print(k, 'ms', round(statistics.median(x[1][k] for x in tot) * 1e3, 2))
