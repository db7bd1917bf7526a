"""Session 9's per-request split (simulated TTFT, live TTFT, engine queue, compute, time outside the
worker's call) with the session-8 AMD profile; the script itself is ../session11/per_request.py.

Usage (repo root): PYTHONPATH=. .venv/bin/python docs/results/calibration/session9/per_request.py \
    pd:0:1:1 RUN.bench.json RUN.requests.json [--cores 2]
"""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.argv[1:1] = ["--profile", str(ROOT / "cpd/costmodel/profiles/smollm2-135m-amd-t1.json")]
runpy.run_path(str(Path(__file__).resolve().parents[1] / "session11/per_request.py"), run_name="__main__")
