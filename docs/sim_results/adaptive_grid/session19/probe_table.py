"""Session 19: the "short work still fits" probe (probe_fits_share.py) against today's rule, per seed.
Best other: output 100 from this session's grid (queue_remaining on); output 400 from session 18's rows
without queue_remaining (../session18/searches.jsonl, the same code as today's default)."""
import glob, json
from pathlib import Path

H = Path(__file__).resolve().parent
probe = {s: {} for s in ("0.75", "1.0")}
for s in probe:
    for l in open(H / f"probe_fits_share_{s}.jsonl"):
        d = json.loads(l)
        probe[s][d["spec"]] = d["sat"]
off = {json.loads(l)["spec"]: json.loads(l)["sat"] for l in open(H / "ab_queue_remaining_off.jsonl") if '"spec"' in l}
probe["1.0"].update({k: v for k, v in off.items() if k not in probe["1.0"]})
grid = {}
for f in glob.glob(str(H / "agent/cells/*.json")):
    d = json.load(open(f)); c = d["cell"]; sat = d["result"]["saturation"]
    for i, seed in enumerate(d["result"]["seeds"]):
        grid[f"{c['cold']:g}:{c['ttft_s']:g}:{c['output']}:{seed}"] = {k: v["per_seed"][i] for k, v in sat.items()}
s18 = {}
for l in open(H.parent / "session18/searches.jsonl"):
    d = json.loads(l)
    if d["spec"].startswith("agent"):
        wl, t, o, seed = d["spec"].split(":")
        s18.setdefault(f"{float(wl[5:]):g}:{float(t):g}:{o}:{seed}", {})[d["cfg"]] = d["sat"]
print("| cell:seed | best other | today's rule (1.0) | ratio | probe 0.75 | ratio |")
print("|---|---:|---:|---:|---:|---:|")
for spec in probe["0.75"]:
    cold, t, o, seed = spec.split(":")
    key = f"{float(cold):g}:{float(t):g}:{o}:{seed}"
    src = grid if o == "100" else s18
    others = {k: v for k, v in src.get(key, {}).items() if k != "cpd"}
    best = max(others.values()) if others else None
    base = probe["1.0"].get(spec) if o == "100" else src.get(key, {}).get("cpd")
    new = probe["0.75"][spec]
    r = lambda x: "—" if x is None or not best else f"{x / best:.3f}"
    print(f"| {spec} | {best} | {base} | {r(base)} | {new} | {r(new)} |")
