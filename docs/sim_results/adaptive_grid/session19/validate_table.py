"""Session 19: adaptive cpd with 5fdb48a's spill rule (queue_remaining off), validate_fits_share.jsonl, against
this session's one-commit grid (18b70d8, queue_remaining on) per seed: the grid's best other, the grid's cpd and
the new cpd. (The other configurations do not route adaptively; queue_remaining moves them a little.)"""
import glob, json
from pathlib import Path

H = Path(__file__).resolve().parent
WL = {"cc": "claude-code", "mc": "mooncake"}
grid = {}
for f in glob.glob(str(H / "*/cells/*.json")):
    d = json.load(open(f)); c = d["cell"]; sat = d["result"]["saturation"]
    for i, seed in enumerate(d["result"]["seeds"]):
        grid[(c["workload"], c["cold"], float(c["ttft_s"]), int(c["output"]), seed)] = {k: v["per_seed"][i] for k, v in sat.items()}
print("| cell:seed | best other (grid) | cpd (grid) | ratio | cpd (5fdb48a) | ratio |")
print("|---|---:|---:|---:|---:|---:|")
for l in open(H / "validate_fits_share.jsonl"):
    d = json.loads(l)
    wl, t, o, seed = d["spec"].split(":")
    key = (WL.get(wl, "agent"), None if wl in WL else float(wl[5:]), float(t), int(o), int(seed))
    g = grid.get(key)
    if not g:
        print(f"| {d['spec']} | — | — | — | {d['sat']} | — |"); continue
    best = max(v for k, v in g.items() if k != "cpd")
    r = lambda x: f"{x / best:.3f}" if best else "—"
    print(f"| {d['spec']} | {best} | {g['cpd']} | {r(g['cpd'])} | {d['sat']} | {r(d['sat'])} |")
