"""Per-request predicted vs live TTFT for one config of a predict_live_ttft run (same slice flags).

Usage (repo root): PYTHONPATH=. .venv/bin/python docs/results/calibration/amd_session8/per_request.py \
    pd:0:1:1 LIVE.bench.json [spread]"""
import json, sys, argparse
sys.path.insert(0, '.')
sys.argv = [sys.argv[0]] + sys.argv[1:]
import benchmarks.predict_live_ttft as P
from cpd.costmodel.calibrated import CalibratedCostModel
cfg, bench = sys.argv[1], sys.argv[2]
SPREAD = len(sys.argv) > 3
a = argparse.Namespace(trace=P.DEFAULT_TRACE, requests=60, tokens_per_hash_id=16, time_scale=0.1,
                       max_output_tokens=4, context_len=8192, kv_event_delay_s=0.02, spread_ticks=SPREAD)
cost = CalibratedCostModel.load('cpd/costmodel/profiles/smollm2-135m-amd-t1.json')
# rerun predict's simulation but keep the records
import cpd.sim.engine_sim as ES
orig = ES.EngineSimulator.run
keep = {}
def run(self):
    r = orig(self); keep['sim'] = r; return r
ES.EngineSimulator.run = run
P.EngineSimulator.run = run
out = P.predict(cost, cfg, a)
sim = keep['sim']
recs = [r for r in sim.rec if r is not None]
live = json.load(open(bench))['records']
print('n sim', len(recs), 'n live', len(live))
rows = []
for i, (s, l) in enumerate(zip(recs, live)):
    st = s['ttft_t'] - s['arrival']
    rows.append((i, l['arrival_s'], l['prompt_len'], st, l['ttft_s']))
for r in rows:
    print("%2d arr %6.1f len %5d sim %6.2f live %6.2f ratio %.2f" % (r[0], r[1], r[2], r[3], r[4], r[4] / max(r[3], 1e-9)))
