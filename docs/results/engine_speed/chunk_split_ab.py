"""Chunked prefill (2048 tokens in 512-token chunks) vs one step, cpd at tree OLD vs tree NEW,
interleaved: one process per tree holding a one-step and a chunked engine (1 torch thread,
float32, nice 10); every repetition runs old one-step, old chunked, new one-step, new chunked
with the same prompt (the first repetition is a warm-up and is dropped).

Usage: python chunk_split_ab.py OLD_TREE NEW_TREE REPS OUT.json"""
import json, os, statistics, subprocess, sys
WORKER = r'''
import json, sys, torch
torch.set_num_threads(1)
from benchmarks.bench_engine import CpdSide, _prompts
from cpd.engine.weights import default_model_dir
md = default_model_dir()
sides = {"one": CpdSide(md, torch.float32, 4096, 1), "chunked": CpdSide(md, torch.float32, 4096, 1, chunk_tokens=512)}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    ps = _prompts(cmd["seed"], 1, 2048, sides["one"].vocab)
    print(json.dumps(sides[cmd["side"]].prefill_s(ps)), flush=True)
'''
def start(tree):
    p = subprocess.Popen(["nice", "-n", "10", "/work/main/.venv/bin/python", "-c", WORKER], cwd=tree,
                         env={**os.environ, "PYTHONPATH": tree}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    json.loads(p.stdout.readline())
    return p
def ask(p, side, seed):
    p.stdin.write(json.dumps({"side": side, "seed": seed}) + "\n"); p.stdin.flush()
    return json.loads(p.stdout.readline())
old_tree, new_tree, reps, out_json = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ws = {"old": start(old_tree), "new": start(new_tree)}
res = {"loadavg_start": os.getloadavg(), "laps": {f"{t}_{s}": [] for t in ws for s in ("one", "chunked")}}
for r in range(reps + 1):
    for t, p in ws.items():
        for s in ("one", "chunked"):
            lap = ask(p, s, 9000 + r)
            if r:
                res["laps"][f"{t}_{s}"].append(lap)
    print(r, {k: v[-1] for k, v in res["laps"].items() if v}, flush=True)
res["loadavg_end"] = os.getloadavg()
summ = {}
for i, unit in ((0, "wall"), (1, "cpu")):
    for t in ws:
        one, ch = [x[i] for x in res["laps"][f"{t}_one"]], [x[i] for x in res["laps"][f"{t}_chunked"]]
        per_rep = [a / b for a, b in zip(one, ch)]  # chunked / one step as a speed ratio (1 = as fast)
        summ[f"{t}_{unit}"] = {"one_s": statistics.median(one), "chunked_s": statistics.median(ch),
                               "ratio_median": statistics.median(per_rep), "ratio_range": [min(per_rep), max(per_rep)]}
    o, n = [x[i] for x in res["laps"]["old_chunked"]], [x[i] for x in res["laps"]["new_chunked"]]
    summ[f"chunked_new_over_old_{unit}"] = statistics.median(a / b for a, b in zip(o, n))
res["summary"] = summ
for p in ws.values():
    p.stdin.close(); p.wait()
json.dump(res, open(out_json, "w"), indent=1)
print(json.dumps(summ, indent=1))
