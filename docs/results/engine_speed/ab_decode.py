"""Interleaved decode A/B for issue 13 (AMD EPYC section of README.md): cpd at tree OLD vs cpd at
tree NEW vs transformers, each in its own process holding its model; every repetition runs
old, new, transformers back to back (1 torch thread, float32, nice 10; AB_NICE=19 for nice 19).

Usage: python ab_decode.py OLD_TREE NEW_TREE DECODE_POINTS PREFILL_POINTS REPS STEPS OUT.json
(e.g. `git worktree add --detach /tmp/old OLD_COMMIT` or `git archive OLD_COMMIT | tar -x -C /tmp/old`, then
`ab_decode.py /tmp/old /work/main 1x512,1x2048,8x512 "" 3 8 out.json`)."""
import json, os, statistics, subprocess, sys, time
WORKER = r'''
import json, sys, torch
torch.set_num_threads(1)
from benchmarks.bench_engine import CpdSide, HfSide, _prompts
from cpd.engine.weights import default_model_dir
side, max_tokens, max_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
md = default_model_dir()
s = CpdSide(md, torch.float32, max_tokens, max_seqs) if side == "cpd" else HfSide(md, torch.float32)
print(json.dumps({"ready": side}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    ps = _prompts(cmd["seed"], cmd["b"], cmd["n"], 49152)
    if cmd["op"] == "decode":
        out = s.decode_step_s(ps, cmd["steps"])[1:]
    else:
        out = [s.prefill_s(ps)]
    print(json.dumps(out), flush=True)
'''
def start(tree, side, mt, ms):
    p = subprocess.Popen(["nice", "-n", os.environ.get("AB_NICE", "10"), "/work/main/.venv/bin/python", "-c", WORKER, side, str(mt), str(ms)],
                         cwd=tree, env={**os.environ, "PYTHONPATH": tree}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    json.loads(p.stdout.readline())
    return p
def ask(p, cmd):
    p.stdin.write(json.dumps(cmd) + "\n"); p.stdin.flush()
    return json.loads(p.stdout.readline())
old_tree, new_tree = sys.argv[1], sys.argv[2]
dec = [tuple(int(v) for v in (x if "x" in x else "1x" + x).split("x")) for x in sys.argv[3].split(",") if x]
pre = [tuple(int(v) for v in (x if "x" in x else "1x" + x).split("x")) for x in sys.argv[4].split(",") if x]
reps, steps, out_json = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
mt = max([b * n for b, n in dec + pre] + [512]); ms = max([b for b, _ in dec + pre] + [1])
ws = {"old": start(old_tree, "cpd", mt, ms), "new": start(new_tree, "cpd", mt, ms), "hf": start(new_tree, "hf", mt, ms)}
res = {"loadavg_start": os.getloadavg(), "decode": {}, "prefill": {}}
med = lambda laps, i: statistics.median(x[i] for x in laps)
for op, pts in (("prefill", pre), ("decode", dec)):
    for b, n in pts:
        laps = {k: [] for k in ws}
        for r in range(reps + (1 if op == "prefill" else 0)):
            for k, p in ws.items():
                got = ask(p, {"op": op, "b": b, "n": n, "steps": steps, "seed": 7000 + 1000 * r + n})
                if op == "decode" or r:
                    laps[k] += got
        row = {}
        for k in ws:
            row[k + "_wall"], row[k + "_cpu"] = med(laps[k], 0), med(laps[k], 1)
        if op == "decode":
            for k in ("old", "new"):
                row[k + "_ratio_cpu"] = row["hf_cpu"] / row[k + "_cpu"]; row[k + "_ratio_wall"] = row["hf_wall"] / row[k + "_wall"]
        else:
            for k in ("old", "new"):
                row[k + "_ratio_cpu"] = row["hf_cpu"] / row[k + "_cpu"]; row[k + "_ratio_wall"] = row["hf_wall"] / row[k + "_wall"]
        row["new_vs_old_cpu"] = row["old_cpu"] / row["new_cpu"]
        for k in ("old", "new"):  # per repetition (prefill) or step (decode): the spread of the ratio
            row[k + "_ratio_cpu_reps"] = [h[1] / c[1] for h, c in zip(laps["hf"], laps[k])]
            row[k + "_ratio_wall_reps"] = [h[0] / c[0] for h, c in zip(laps["hf"], laps[k])]
        res[op][f"{b}x{n}"] = row
        print(op, f"{b}x{n}", {k: round(v * 1e3, 1) if "ratio" not in k and "_vs_" not in k and k.endswith(("_wall", "_cpu")) else
                                     [round(x, 3) for x in v] if isinstance(v, list) else round(v, 3)
                                     for k, v in row.items()}, flush=True)
res["loadavg_end"] = os.getloadavg()
json.dump(res, open(out_json, "w"), indent=1)
for p in ws.values(): p.stdin.close(); p.wait()
