"""Per seed, adaptive cpd / best other in session 19's one-commit grid (18b70d8) and in this one (6d3ad44).
    cd docs/sim_results/adaptive_grid/session20 && ../../../../.venv/bin/python compare.py > compare.md"""
from pathlib import Path

from table import RUNS, session19_table

HERE = Path(__file__).resolve().parent
T = session19_table()


def cells(folder: Path) -> dict:
    return {(r["cell"]["workload"], r["cell"].get("cold"), r["cell"]["ttft_s"], r["cell"]["output"]):
            r["result"]["ratio_per_seed"] for r in T.rows(folder, RUNS)}


old, new = cells(HERE.parent / "session19"), cells(HERE)
print("| cell (workload, cold, TTFT, output) | session 19 per seed | session 20 per seed |")
print("|---|---|---|")
up = down = 0
f = lambda rs: ", ".join("—" if x is None else (f"**{x:.3f}**" if x < T.LINE else f"{x:.3f}") for x in rs)
for k in sorted(new, key=lambda k: (k[0], k[1] or 0, k[2], k[3])):
    o = old.get(k)
    print(f"| {', '.join(str(x) for x in k)} | {f(o) if o else '—'} | {f(new[k])} |")
    for a, b in zip(o or [], new[k]):
        if a is not None and b is not None:
            up += b > a + 1e-9
            down += b < a - 1e-9
print(f"\nSeeds higher in session 20: {up}, lower: {down} (ratios against each session's own best other).")
