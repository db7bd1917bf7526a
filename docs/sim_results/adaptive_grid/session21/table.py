"""Session 21's grid on one commit (issue 11; adaptive cpd on 977632c, pd, pd-l3 and cpd-static from
session 20's 6d3ad44, whose code path for them is the same: check_baselines.jsonl): its grid runs' cells
in one table and one heat map, by session 19's table code (``../session19/table.py``).

    cd docs/sim_results/adaptive_grid/session21 && ../../../../.venv/bin/python table.py > table.md

Reads agent/, mooncake/, claude_code/ and claude_code_400/ (each a ``benchmarks/adaptive_grid.py --out`` folder)
and writes grid_heatmap.png beside this file.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = ("agent", "mooncake", "claude_code", "claude_code_400")


def session19_table():
    """``../session19/table.py`` as a module (the session folders are not packages)."""
    spec = importlib.util.spec_from_file_location("session19_table", HERE.parent / "session19" / "table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    session19_table().main(HERE, RUNS)
