"""Per-seed table of the session-17 cpd searches against the recorded figures. Run from this folder:
python table.py (reads quick_searches.jsonl, cc_searches.jsonl, long_searches.jsonl)."""
import json

# (adaptive record on 72c0475 = a21ba29's rule, best other record and its configuration), ../a3_session16/README.md
RECORD = {
    "agent0.15:1:400:1": (0.2613, 0.2475, "cpd-static"), "agent0.15:1:400:2": (0.2931, 0.2692, "cpd-static"),
    "agent0.15:1:400:3": (0.4525, 0.4857, "pd-l3"),
    "agent0.08:1:400:1": (0.6074, 0.6061, "pd-l3"), "agent0.08:1:400:2": (0.6336, 0.6021, "pd-l3"),
    "agent0.08:1:400:3": (0.6449, 0.6427, "pd-l3"),
    "agent0.03:0.5:400:1": (0.5577, 0.5692, "pd-l3"), "agent0.03:0.5:400:2": (0.6260, 0.6264, "cpd-static"),
    "agent0.03:0.5:400:3": (0.6231, 0.6364, "pd-l3"),
    "agent0.08:0.5:400:1": (0.4486, 0.4463, "cpd-static"), "agent0.08:0.5:400:2": (0.5143, 0.5039, "cpd-static"),
    "agent0.08:0.5:400:3": (0.6151, 0.6180, "pd-l3"),
    "cc:0.5:400:1": (3.6548, 3.2527, "cpd-static"), "cc:0.5:400:2": (4.1925, 4.0527, "cpd-static"),
    "cc:1:400:1": (4.1356, 3.7141, "pd-l3"), "cc:1:100:1": (4.1152, 3.6704, "pd-l3"),
    "cc:2:400:1": (4.8739, 4.6749, "pd-l3"), "mc:1:100:1": (2.0632, 1.9517, "pd-l3"),
    "cc:0.5:400:3": (4.3456, 4.0968, "cpd-static"), "cc:1:400:2": (4.4049, 4.1442, "cpd-static"),
    "cc:1:400:3": (4.8534, 4.2280, "cpd-static"), "cc:0.5:100:1": (3.6466, 3.2315, "cpd-static"),
    "cc:0.5:100:2": (4.2099, 4.0644, "cpd-static"), "cc:0.5:100:3": (4.3791, 4.0993, "cpd-static"),
    "cc:1:100:2": (4.3884, 4.1460, "cpd-static"), "cc:1:100:3": (4.8622, 4.2421, "cpd-static"),
    "agent0:0.5:400:1": (0.6455, 0.6449, "pd"), "agent0:0.5:400:2": (0.6640, 0.6748, "pd-l3"),
    "agent0:0.5:400:3": (0.6447, 0.6447, "pd-l3"), "agent0.03:1:400:1": (0.6502, 0.6474, "pd-l3"),
    "agent0.03:1:400:2": (0.6517, 0.6452, "cpd-static"), "agent0.03:1:400:3": (0.6401, 0.6459, "pd-l3"),
    "agent0:1:400:1": (0.6455, 0.6455, "pd"), "agent0:1:400:2": (0.6675, 0.6748, "pd-l3"),
    "agent0:1:400:3": (0.6447, 0.6447, "pd-l3"),
}


def rows(path):
    try:
        return [json.loads(line) for line in open(path)]
    except FileNotFoundError:
        return []


def main():
    cands = ["fix", "fixfactor2", "fixfactor1", "fixfactor0"]  # 0bb9cf6 with HOPELESS_WAIT_FACTOR 4, 2 (= d933aa1), 1, 0
    got = {}
    for r in rows("quick_searches.jsonl") + rows("cc_searches.jsonl"):
        if r["cfg"] == "cpd":
            cand = {"d933aa1": "fixfactor2", "fixfactor4": "fix"}.get(r["cand"], r["cand"])  # the same code
            got[(r["spec"].rsplit(":", 1)[0], cand)] = r["sat"]
    heads = ["factor 4 (0bb9cf6)", "factor 2 (d933aa1)", "factor 1", "factor 0"]
    print("| cell (wl:TTFT:out:seed) | best other (record) | adaptive record | " + " | ".join(heads) + " |")
    print("|---|---|---:|" + "---:|" * len(cands))
    for spec, (ad, best, cfg) in RECORD.items():
        cells = []
        for c in cands:
            v = got.get((spec, c))
            cells.append("–" if v is None else f"{v:.4f} ({v / best:.3f})")
        print(f"| {spec} | {best:.4f} `{cfg}` | {ad:.4f} ({ad / best:.3f}) | " + " | ".join(cells) + " |")
    print()
    print("| 120 s window (wl:TTFT:out:seed) | config / candidate | saturation | points (QPS/GPU, goodput, requests) |")
    print("|---|---|---:|---|")
    seen = set()
    for r in sorted(rows("long_searches.jsonl"), key=lambda r: (r["spec"].split(":")[3], r["cfg"] == "cpd")):
        name = r["cfg"] if r["cfg"] != "cpd" else f"cpd {r['cand']}"
        cell = ":".join(r["spec"].split(":")[:4])
        if (cell, name) in seen:
            continue
        seen.add((cell, name))
        pts = ", ".join(f"{q} {g:.3f} ({n})" for q, g, n in r["points"])
        print(f"| {cell} | {name} | {r['sat']} | {pts} |")


main()
