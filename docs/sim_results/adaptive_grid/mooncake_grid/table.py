"""The Mooncake grid table of README.md from the run's files: whole cells of
``benchmarks/adaptive_grid.py`` (``cells/*.json``), per-(seed, configuration) searches of
``../claude_code_grid/cell_searches.py`` (``searches.jsonl``, on commit ``SEARCH_CODE``) and the TTFT 1 s / output 100 cell of
``../mooncake_heavy_quarter/grid.json`` (commit 8570904). Seeds whose four searches are not all
done are listed without a ratio. Run from the repository root:

    python3 docs/sim_results/adaptive_grid/mooncake_grid/table.py
"""
import json
import math
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = ("pd", "pd-l3", "cpd-static", "cpd")
SEARCH_CODE = "864cf15"  # the commit the per-search runs of searches.jsonl ran on (sim_out/moon400/COMMIT)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}


def from_cells() -> dict:
    out = {}
    files = sorted((HERE / "cells").glob("*.json")) + [HERE.parent / "mooncake_heavy_quarter" / "grid.json"]
    for f in files:
        d = json.loads(f.read_text())
        for row in d.get("cells", [d]):
            c, s = row["cell"], row["result"]
            src = "8570904 (../mooncake_heavy_quarter)" if "heavy_quarter" in str(f) else d.get("code", "31a74a3")
            for k, seed in enumerate(s["seeds"]):
                out.setdefault((c["ttft_s"], c["output"]), {"src": src, "seeds": {}})["seeds"][seed] = \
                    {cfg: s["saturation"][cfg]["per_seed"][k] for cfg in CONFIGS}
    return out


def from_searches(out: dict) -> None:
    f = HERE / "searches.jsonl"
    if not f.exists():
        return
    for line in f.read_text().splitlines():
        r = json.loads(line)
        key = (r["cell"][1], r["cell"][2])
        cell = out.setdefault(key, {"src": f"{SEARCH_CODE} (searches.jsonl)", "seeds": {}})
        cell["seeds"].setdefault(r["seed"], {})[r["cfg"]] = r["sat"] or 0.0


def ci(xs: list) -> str:
    if not xs:
        return "—"
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return f"{m:.3f} (1 seed)"
    h = T975[len(xs) - 1] * math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
    return f"{m:.3f} [{m - h:.3f}, {m + h:.3f}]"


def main() -> None:
    cells = from_cells()
    from_searches(cells)
    print("| TTFT SLO | output | seed | pd | pd-l3 | cpd-static | cpd (adaptive) | best other | ratio | code |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    summary = []
    for (ttft, out), cell in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ratios = []
        for seed, v in sorted(cell["seeds"].items()):
            vals = " | ".join(f"{v[c]:.4f}" if c in v else "…" for c in CONFIGS)
            if all(c in v for c in CONFIGS):
                best = max(CONFIGS[:3], key=lambda c: v[c])
                ratios.append(v["cpd"] / v[best])
                tail = f"{best} | **{ratios[-1]:.3f}**"
            else:
                tail = "— | —"
            print(f"| {ttft:g} s | {out} | {seed} | {vals} | {tail} | {cell['src']} |")
        summary.append(f"| {ttft:g} s | {out} | {len(ratios)} | {ci(ratios)} | "
                       f"{min(ratios):.3f} |" if ratios else f"| {ttft:g} s | {out} | 0 | — | — |")
    print("\n| TTFT SLO | output | seeds | ratio mean [95 % t-CI] | lowest seed |\n|---:|---:|---:|---|---:|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
