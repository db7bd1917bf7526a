import json, sys
REC = {  # spec prefix -> (old adaptive, best other, best other name, code of the record)
 "cc:0.5:400:1": (3.6077, 3.2527, "cpd-static", "8e2623a"), "cc:0.5:400:2": (3.8106, 4.0527, "cpd-static", "8e2623a"),
 "cc:0.5:400:3": (4.0225, 4.0968, "cpd-static", "8e2623a"),
 "cc:0.5:100:1": (3.551, 3.2315, "cpd-static", "8890a00"), "cc:0.5:100:2": (3.8756, 4.0644, "cpd-static", "8890a00"),
 "cc:0.5:100:3": (4.1642, 4.0993, "cpd-static", "8890a00"),
 "cc:1:400:1": (4.2496, 3.7141, "pd-l3", "8e2623a"), "cc:1:400:2": (4.2484, 4.1442, "cpd-static", "8e2623a"),
 "cc:1:400:3": (4.7372, 4.228, "cpd-static", "8e2623a"),
 "cc:1:100:1": (4.184, 3.6704, "pd-l3", "864cf15"), "cc:1:100:2": (4.3965, 4.146, "cpd-static", "864cf15"),
 "cc:1:100:3": (4.965, 4.2421, "cpd-static", "864cf15"),
 "cc:2:100:1": (4.7851, 4.6719, "pd-l3", "8890a00"), "cc:2:400:1": (4.9696, 4.6749, "pd-l3", "8e2623a"),
 "agent0.03:0.5:400:1": (0.5577, 0.5692, "pd-l3", "8890a00"), "agent0.03:0.5:400:3": (0.6231, 0.6364, "pd-l3", "8890a00"),
 "agent0.08:0.5:400:1": (0.4486, 0.4463, "cpd-static", "8890a00"), "agent0.08:0.5:400:2": (0.5143, 0.5039, "cpd-static", "8890a00"),
 "agent0.08:0.5:400:3": (0.6153, 0.618, "pd-l3", "8890a00"), "agent0.15:1:400:3": (0.4525, 0.4857, "pd-l3", "8890a00"),
 "agent0.03:0.5:400:2": (0.6272, 0.6264, "cpd-static", "8890a00"),
 "agent0:0.5:400:1": (0.6455, 0.6449, "pd", "8890a00"), "agent0:0.5:400:2": (0.664, 0.6748, "pd-l3", "8890a00"),
 "agent0:0.5:400:3": (0.6447, 0.6447, "pd-l3", "8890a00"),
 "agent0.03:1:400:1": (0.6502, 0.6474, "pd-l3", "8890a00"), "agent0.03:1:400:2": (0.6517, 0.6452, "cpd-static", "8890a00"),
 "agent0.03:1:400:3": (0.6401, 0.6459, "pd-l3", "8890a00"),
 "agent0.08:1:400:1": (0.6074, 0.6061, "pd-l3", "8890a00"), "agent0.08:1:400:2": (0.6336, 0.6021, "pd-l3", "8890a00"),
 "agent0.08:1:400:3": (0.6449, 0.6427, "pd-l3", "8890a00"),
 "agent0.15:1:400:1": (0.2613, 0.2475, "cpd-static", "8890a00"), "agent0.15:1:400:2": (0.2931, 0.2692, "cpd-static", "8890a00"),
 "agent0:1:400:1": (0.6455, 0.6455, "pd", "8890a00"), "agent0:1:400:2": (0.6675, 0.6748, "pd-l3", "8890a00"),
 "agent0:1:400:3": (0.6447, 0.6447, "pd-l3", "8890a00"),
 "mc:1:100:1": (2.0229, 1.9517, "pd-l3", "8570904"),
}
NAME = {"cc": "Claude Code", "mc": "Mooncake", "agent": "agent cold "}
seen = {}
for l in open(sys.argv[1]):
    r = json.loads(l); k = r["spec"].rsplit(":", 1)[0]; seen[k] = r
print("| cell (TTFT s / output) | seed | adaptive before (record) | adaptive 72c0475 | best other (record) | ratio before | ratio now | hopeless spills priced / refused |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for k, (old, best, bn, code) in REC.items():
    if k not in seen: continue
    r = seen[k]; wl, t, o, sd = k.split(":")
    cell = (f"agent cold {wl[5:]}" if wl.startswith("agent") else NAME[wl]) + f" {t} / {o}"
    d = r["decisions"]
    print(f"| {cell} | {sd} | {old:.4f} ({code}) | {r['goodput']:.4f} | {best:.4f} `{bn}` | {old/best:.3f} | **{r['goodput']/best:.3f}** | {d.get('hopeless_priced',0)} / {d.get('hopeless_blocked',0)} |")
