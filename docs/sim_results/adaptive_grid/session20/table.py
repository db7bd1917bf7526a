"""Session 20's grid on one commit (6d3ad44) (issue 11): its grid runs' cells in one table and one heat map,
by session 19's table code (``../session19/table.py``) on this folder's runs.

    cd docs/sim_results/adaptive_grid/session20 && ../../../../.venv/bin/python table.py > table.md

Reads agent/, mooncake/, claude_code/ and claude_code_b/ (each a ``benchmarks/adaptive_grid.py --out`` folder)
and writes grid_heatmap.png beside this file.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = ("agent", "mooncake", "claude_code", "claude_code_b")


def session19_table():
    """``../session19/table.py`` as a module (the session folders are not packages)."""
    spec = importlib.util.spec_from_file_location("session19_table", HERE.parent / "session19" / "table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    session19_table().main(HERE, RUNS)
