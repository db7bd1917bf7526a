"""Per request of one live run: the simulator's TTFT, the live TTFT (client), and the live split
from the router's /cpd/requests record (engine queue, the worker's compute, and the time outside
the worker's prefill call: router, HTTP and — before 4b83705 — the handoff staging).

Usage (repo root): PYTHONPATH=. .venv/bin/python docs/results/calibration/session11/per_request.py \
    pd:0:1:1 RUN.bench.json RUN.requests.json [--start ROW] [--profile PATH] [--cores 2]
(the slices of predict_live_ttft's runs: 60 Mooncake requests from row ROW, time scale 0.1, spread
ticks; the profile defaults to the session-10 quiet calibration). Session 9's copy, with the older
profile and the first slice only: ../session9/per_request.py.
"""
import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
spec = importlib.util.spec_from_file_location("plt", ROOT / "benchmarks/predict_live_ttft.py")
P = importlib.util.module_from_spec(spec)
spec.loader.exec_module(P)
from cpd.costmodel.calibrated import CalibratedCostModel  # noqa: E402
import cpd.sim.engine_sim as ES  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("bench")
ap.add_argument("records")
ap.add_argument("--cores", type=int, default=0)
ap.add_argument("--start", type=int, default=0)
ap.add_argument("--profile", default=str(ROOT / "cpd/costmodel/profiles/smollm2-135m-amd-t1-s10.json"))
args = ap.parse_args()
a = P.build_parser().parse_args(["--profile", args.profile, "--requests", "60", "--time-scale", "0.1", "--spread-ticks",
                                 "--start", str(args.start), "--cores", str(args.cores), "--out", "unused.json"])
keep = {}
orig = ES.EngineSimulator.run


def run(self):
    keep["sim"] = orig(self)
    return keep["sim"]


ES.EngineSimulator.run = run
P.predict(CalibratedCostModel.load(args.profile), args.config, a)
sim = [r for r in keep["sim"].rec if r is not None]
live = json.loads(Path(args.bench).read_text())["records"]
recs = list(json.loads(Path(args.records).read_text()).values())
print(" i  tokens  sim_s  live_s  queue_s  compute_s  outside_s")
outside = []
for i, (s, b) in enumerate(zip(sim, live)):
    # the router's record of this request: same prompt length, the closest TTFT (ids differ)
    r = min((r for r in recs if r["prompt_tokens"] == b["prompt_len"]), key=lambda r: abs(r["ttft_s"] - b["ttft_s"]))
    out = b["ttft_s"] - r["worker_prefill_s"]
    outside.append(out)
    print(f"{i:2d} {b['prompt_len']:6d} {s['ttft_t'] - s['arrival']:6.2f} {b['ttft_s']:7.2f} {r['worker_queue_s']:8.2f} "
          f"{r['worker_compute_s']:10.2f} {out:10.3f}")
outside.sort()
print(f"outside the worker's call: median {outside[len(outside) // 2]:.3f} s, max {outside[-1]:.3f} s, "
      f"sum {sum(outside):.1f} s over {len(outside)} requests")
