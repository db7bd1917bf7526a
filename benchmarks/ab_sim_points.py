"""A/B speed of the engine-object simulator on fixed points, one point per process (so that peak
RSS is the point's own): CPU seconds of the process (``time.process_time``), peak RSS, and the
point's JSON written to a file (with a sha256 of the per-request records, which the summary
aggregates), to compare two code trees byte for byte.

    .venv/bin/python benchmarks/ab_sim_points.py --code DIR --point cpd:1.0:1 --json out.json [--profile f.prof]

``--code``: the tree whose ``cpd`` package runs (a ``git archive`` snapshot of another commit, or
``.``). Points are ``config:qps_per_gpu:seed`` on the quick adaptive-grid experiment
(``benchmarks/adaptive_grid.py --quick``: 5 s ramp + 20 s arrivals + 10 s drain), agent workload
cold 0.03, TTFT SLO 1 s, output 100; ``--workload mooncake`` uses the Mooncake conversation trace
cell instead; ``--steady-s`` lengthens the window. Run old and new interleaved (same load) and compare the JSON files with ``cmp``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", required=True)
    ap.add_argument("--point", required=True, help="config:qps_per_gpu:seed")
    ap.add_argument("--workload", default="agent", choices=("agent", "mooncake", "claude-code"))
    ap.add_argument("--json", required=True)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--steady-s", type=float, default=None, help="arrivals after the ramp (default: the quick 20 s)")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.code).resolve()))
    sys.path.insert(1, str(Path(a.code).resolve() / "benchmarks"))
    import adaptive_grid as ag
    import cpd.sim.experiment as ex

    cfg, qps, seed = a.point.split(":")
    exp = ag.with_overrides(ex.load_experiment("reference_b200"), ag.QUICK_EXP)
    cell = {"workload": a.workload, "cold": 0.03 if a.workload == "agent" else None, "ttft_s": 1.0, "output": 100}
    exp = ag.cell_experiment(exp, cell)
    if a.steady_s is not None:
        exp["steady_s"] = a.steady_s
    sims = []
    orig_run = ex.EngineSimulator.run

    def run(self):  # keep the simulator to hash its per-request records
        sims.append(self)
        return orig_run(self)
    ex.EngineSimulator.run = run
    prof = None
    if a.profile:
        import cProfile
        prof = cProfile.Profile()
    c0 = time.process_time()
    if prof is not None:
        prof.enable()
    p = ex.run_point(exp, cfg, float(qps), seed=int(seed))
    if prof is not None:
        prof.disable()
        prof.dump_stats(a.profile)
    cpu = time.process_time() - c0
    rec = hashlib.sha256(json.dumps(sims[0].rec, sort_keys=True).encode()).hexdigest()
    p["records_sha256"] = rec
    Path(a.json).write_text(json.dumps(p, sort_keys=True, indent=1) + "\n")
    print(json.dumps({"code": a.code, "point": a.point, "workload": a.workload, "cpu_s": round(cpu, 2),
                      "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "simulated_s": p["simulated_s"], "requests": p["requests"], "records_sha256": rec[:16]}),
          flush=True)


if __name__ == "__main__":
    main()
