"""``../claude_code_grid/cell_searches.py`` unchanged (same searches, same one-line summaries in
``--out``), plus a side file ``--points FILE`` that keeps each search's whole result: every simulated
point (busy fraction per pool, pool shares, TTFT/TPOT percentiles, goodput), the search's wall time
and the machine's load average (1 min) before and after it. Run from the repository root (or a
snapshot of it):

    PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/mooncake_grid/searches_with_points.py \
        EXPERIMENT WORKLOAD TTFT_S OUTPUT_TOKENS --seeds 3 --out FILE.jsonl --points POINTS.jsonl
"""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "claude_code_grid"))
import cell_searches as CS  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    k = argv.index("--points")
    points = Path(argv[k + 1])
    del argv[k:k + 2]
    key = [argv[1], float(argv[2]), int(argv[3])]
    real = CS.search_saturation

    def search(e, cfg, seed):
        load0, t = os.getloadavg()[0], time.perf_counter()
        r = real(e, cfg, seed)
        row = {"cell": key, "seed": seed, "cfg": cfg, "wall_s": round(time.perf_counter() - t),
               "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)], "result": r}
        with points.open("a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        return r
    CS.search_saturation = search
    sys.argv = [sys.argv[0], *argv]
    CS.main()


if __name__ == "__main__":
    main()
