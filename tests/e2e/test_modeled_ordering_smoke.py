"""Smoke test of benchmarks/modeled_ordering.py: one small point, one configuration (cpd-static),
through the simulator and a live modeled deployment built from the script's own mapping of the
named configuration: every request finishes on both sides, the live router sees the same
pools (pre-prefill present: the cpd topology was deployed) and routes each request to the same
class and pool as the simulator, and the written-through cold prompts come back as L3 hits."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "modeled_ordering.py"


def _script():
    spec = importlib.util.spec_from_file_location("modeled_ordering", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_script_runs_one_configuration_on_both_sides(tiny_model_dir):
    mo = _script()
    a = mo.parse_args(["--points", "2", "--duration", "8", "--warm", "0", "--configs", "cpd-static",
                       "--min-turn-gap", "1.5", "--output-tokens", "4"])
    vocab = json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"]
    pt = mo.run_point(a, 2.0, ["cpd-static"], vocab, tiny_model_dir)
    c = pt["configs"]["cpd-static"]
    sim, live = c["sim"], c["live"]
    print(f"\nsim {sim}\nlive {live}\nagree {c['class_pool_agree']}")
    assert sim["requests"] == live["requests"] == pt["num_requests"] > 0
    assert sim["failed"] == 0 and live["failed"] == 0, c["live_errors"]
    assert set(live["pool_share"]) == set(sim["pool_share"]) == {"pre-prefill", "prefill"}
    assert c["class_pool_agree"] >= 0.9
    assert sim["hit_ratio"]["L3"] > 0 and live["hit_ratio"]["L3"] > 0
