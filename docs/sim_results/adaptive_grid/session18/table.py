"""The tables of README.md from searches.jsonl (run in this folder): per cell and label, the four
configurations' saturations, adaptive / best other, and session 17's records side by side."""
import collections, json

OTHERS = ("pd", "pd-l3", "cpd-static")
# session 17 (docs/sim_results/adaptive_grid/session17/README.md, section 4): best other (record) and
# adaptive on d933aa1 (HOPELESS_WAIT_FACTOR 2), router_cost "linear" = today's "linear-flat"
S17 = {"agent0.15:1:400:3": (0.4857, "pd-l3", 0.4621), "agent0.15:1:400:1": (0.2475, "cpd-static", 0.2613),
       "agent0.15:1:400:2": (0.2692, "cpd-static", 0.2931), "agent0.03:0.5:400:1": (0.5692, "pd-l3", 0.6076),
       "agent0.03:0.5:400:2": (0.6264, "cpd-static", 0.6311), "agent0.03:0.5:400:3": (0.6364, "pd-l3", 0.6213),
       "agent0.08:0.5:400:1": (0.4463, "cpd-static", 0.4601), "cc:0.5:400:1": (3.2527, "cpd-static", 3.6673),
       "cc:1:100:1": (3.6704, "pd-l3", 4.1673), "mc:1:100:1": (1.9517, "pd-l3", 2.0632),
       "agent0.08:1:400:1": (0.6061, "pd-l3", 0.6074), "agent0.08:1:400:2": (0.6021, "pd-l3", 0.6336),
       "agent0.08:1:400:3": (0.6427, "pd-l3", 0.6449), "agent0.08:0.5:400:2": (0.5039, "cpd-static", 0.5427),
       "agent0.08:0.5:400:3": (0.6180, "pd-l3", 0.6151), "agent0.03:1:400:1": (0.6474, "pd-l3", 0.6502),
       "agent0.03:1:400:2": (0.6452, "cpd-static", 0.6517), "agent0.03:1:400:3": (0.6459, "pd-l3", 0.6401),
       "agent0:0.5:400:1": (0.6449, "pd", 0.6455), "agent0:0.5:400:2": (0.6748, "pd-l3", 0.6640),
       "agent0:0.5:400:3": (0.6447, "pd-l3", 0.6447), "agent0:1:400:1": (0.6455, "pd", 0.6455),
       "agent0:1:400:2": (0.6748, "pd-l3", 0.6675), "agent0:1:400:3": (0.6447, "pd-l3", 0.6447),
       "cc:0.5:400:2": (4.0527, "cpd-static", 4.2178), "cc:1:400:1": (3.7141, "pd-l3", 4.2429),
       "cc:1:100:3": (4.2421, "cpd-static", 4.7833), "cc:2:400:1": (4.6749, "pd-l3", 4.8739)}
FILES = ("searches.jsonl", "searches_queue_remaining.jsonl", "searches_linear_flat.jsonl")


def main():
    runs = collections.defaultdict(dict)  # (spec, label) -> cfg -> sat
    for name in FILES:
        try:
            lines = open(name).readlines()
        except FileNotFoundError:
            continue
        for line in lines:
            r = json.loads(line)
            runs[(r["spec"], r["label"])][r["cfg"]] = r["sat"]
    print("| cell (wl:TTFT:out:seed) | label | pd | pd-l3 | cpd-static | adaptive cpd | cpd / best other "
          "| session 17: best other | adaptive (d933aa1) | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for spec in S17:
        for (s, label), cf in runs.items():
            if s != spec:
                continue
            best = max((cf[c] for c in OTHERS if c in cf), default=None)
            ratio = f"{cf['cpd'] / best:.3f}" if best and "cpd" in cf and len(cf) == 4 else "–"
            b17, who17, a17 = S17[spec]
            print(f"| {spec} | {label} | " + " | ".join(f"{cf[c]:.4f}" if c in cf else "–" for c in (*OTHERS, "cpd"))
                  + f" | {ratio} | {b17:.4f} `{who17}` | {a17:.4f} | {a17 / b17:.3f} |")


main()
