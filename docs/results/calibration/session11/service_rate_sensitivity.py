"""Prediction error of the live runs of session 11 when every modeled time is scaled by 1.0-1.15 (CalibratedCostModel.scaled): how steeply the predicted TTFT follows the service rate. Run from the repository root: PYTHONPATH=. .venv/bin/python docs/results/calibration/session11/service_rate_sensitivity.py"""
import json, sys
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import predict_live_ttft as P
from cpd.costmodel.calibrated import CalibratedCostModel
cost = CalibratedCostModel.load("cpd/costmodel/profiles/smollm2-135m-amd-t1-s10.json")
S = "docs/results/calibration/session11"
runs = {0: [f"{S}/slice0/spread.json", f"{S}/ab_head/spread.json"], 200: [f"{S}/slice200/spread.json"]}
for factor in (1.0, 1.05, 1.10, 1.15):
    errs = []
    for start, files in runs.items():
        a = P.build_parser().parse_args(["--profile", "x", "--requests", "60", "--time-scale", "0.1", "--spread-ticks",
                                         "--start", str(start), "--out", "x"])
        for f in files:
            for c, v in json.load(open(f))["configs"].items():
                pr = P.predict(cost.scaled(factor), c, a)["ttft_s"]
                for m in v["measured"]:
                    errs.append((start, c, round((pr["p50"] - m["ttft_s"]["p50"]) / m["ttft_s"]["p50"] * 100, 1),
                                 round((pr["p90"] - m["ttft_s"]["p90"]) / m["ttft_s"]["p90"] * 100, 1)))
    within = sum((abs(e[2]) <= 15) + (abs(e[3]) <= 15) for e in errs)
    print(factor, f"within 15 %: {within}/{2*len(errs)}", errs)
