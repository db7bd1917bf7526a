"""The compressed Claude Code sessions LIVE on modeled deployments and in the simulator (issue 11).

The live-vs-simulator machinery is :mod:`benchmarks.modeled_ordering` (both sides built from one
live config, the same request list, the same metrics and ordering rule), run through
:mod:`benchmarks.modeled_ordering_records` (keeps each live run's ``/cpd/requests`` records).
This wrapper only changes the workload and samples the machine's load:

- workload: the shared Claude Code sessions as the simulator's Claude Code cell replays them
  (``docs/sim_results/adaptive_grid/claude_code_grid/``: :func:`cpd.sim.experiment.trace_point`,
  sessions started as a Poisson process at total QPS / mean requests per session, pauses capped at
  ``--max-idle`` s, in-session times / ``--time-scale``, answers capped at ``--max-output`` tokens,
  prompts truncated to the model's context), arrivals over ``--ramp + --steady`` modeled s; the
  metrics window is ``[ramp, ramp + steady)`` (``--warm`` = ramp).
- loads are given as nominal QPS per GPU (``--loads-per-gpu``); total = load × GPUs of the
  modeled layout (3 workers × ``--tp``: ``pd``/``pd-l3`` 2 prefill + 1 decode, ``cpd`` 1
  pre-prefill + 1 prefill + 1 decode).
- every live run samples the 1-minute load average every 5 s (``live_run.load_1m_samples``).

Usage (modeled_ordering's arguments pass through)::

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/claude_code_live_modeled.py \\
        --loads-per-gpu 1,3 --configs pd,pd-l3,cpd --time-dilation 3 \\
        --records-dir DIR --json out.json [--sim-only]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import benchmarks.modeled_ordering as mo  # noqa: E402
import benchmarks.modeled_ordering_records as mor  # noqa: E402
from cpd.policy.cost_model import RooflineCostModel  # noqa: E402
from cpd.sim.experiment import trace_point  # noqa: E402
from cpd.sim.workload import SimRequest  # noqa: E402

CLAUDE_CODE_TRACE = "/work/shared/data/traces/claude_code"
NUM_WORKERS = 3  # modeled_ordering.live_config: every configuration on 3 workers

# The simulator cell's model and scheduler (claude_code_sessions.experiment.json), as defaults of
# modeled_ordering's arguments; the SLOs are the cell's (TTFT 1 s, TPOT 50 ms). L1 blocks: the cell's
# (the roofline's KV capacity of a Llama-3.1-8B tp4 B200 instance / 512 at 2-byte KV); L2 the cell's 3 TB.
# The simulated router learns its cost model as the live router does (modeled_ordering's default
# --router-cost learned: from the workers' advertised CostPrior, cpd/costmodel/prior.py); with
# --router-cost fixed (the figures of 6066ef9) its rate is modeled_ordering.router_cost's (system
# prompt + first context tokens, no cache: one full 16,384-token step, 197 K tok/s).
CELL_DEFAULTS = {"--shape": "Llama-3.1-8B", "--gpu": "b200", "--tp": "4", "--block-size": "512",
                 "--budget": "16384", "--max-num-seqs": "24", "--slo-ttft": "1.0", "--slo-tpot": "0.05",
                 "--system-prompt": "0", "--first-context": "16384",
                 "--l1-blocks": "9416", "--l2-bytes": "3000000000000"}


def claude_code_requests(a: argparse.Namespace, total_qps: float) -> list[SimRequest]:
    """The Claude Code cell's arrivals at ``total_qps`` (module docstring)."""
    w = {"path": a.trace, "max_idle_s": a.max_idle, "time_scale": a.time_scale, "max_output_tokens": a.max_output,
         "context_len": RooflineCostModel.build(a.shape, a.gpu, a.tp).model.max_context}
    return trace_point(w, total_qps, a.duration, a.block_size, a.seed)


class _LoadSampler:
    """The 1-minute load average every ``period_s`` s in a thread."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.period_s, self.samples = period_s, []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(round(os.getloadavg()[0], 2))

    def __enter__(self) -> "_LoadSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loads-per-gpu", default="1,3", help="nominal QPS per GPU (the cell's unit)")
    p.add_argument("--ramp", type=float, default=60.0)
    p.add_argument("--steady", type=float, default=60.0)
    p.add_argument("--time-scale", type=float, default=4.0)
    p.add_argument("--max-idle", type=float, default=20.0)
    p.add_argument("--max-output", type=int, default=100)
    p.add_argument("--trace", default=CLAUDE_CODE_TRACE)
    own, rest = p.parse_known_args(argv)
    for k, v in CELL_DEFAULTS.items():
        if k not in rest:
            rest += [k, v]
    tp = int(rest[rest.index("--tp") + 1])
    gpus = NUM_WORKERS * tp
    points = ",".join(f"{float(x) * gpus:g}" for x in own.loads_per_gpu.split(","))
    rest += ["--points", points, "--duration", f"{own.ramp + own.steady:g}", "--warm", f"{own.ramp:g}"]

    def workload(a: argparse.Namespace, qps: float) -> list[SimRequest]:
        for k, v in vars(own).items():
            setattr(a, k, v)
        return claude_code_requests(a, qps)

    orig_run_live = mo.run_live

    def run_live(a, name, reqs, prompts, model_dir):  # type: ignore[no-untyped-def]
        with _LoadSampler() as ls:
            rows, facts = orig_run_live(a, name, reqs, prompts, model_dir)
        facts["load_1m_samples"] = ls.samples
        return rows, facts

    mo.workload = workload
    mo.run_live = run_live
    if "--sim-only" in rest:
        if "--records-dir" in rest:
            i = rest.index("--records-dir")
            del rest[i:i + 2]
        res = mo.main(rest)
    else:
        res = mor.main(rest)
    res["claude_code"] = {**vars(own), "num_gpus": gpus}
    json_path = rest[rest.index("--json") + 1] if "--json" in rest else ""
    if json_path:
        import json
        Path(json_path).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
