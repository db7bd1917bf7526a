"""What the per-row exact decode attention costs in reduced precision (issue 13).

Since a9b0548, a decode step in bf16 runs one unmasked SDPA call per row over exactly its
own context (``DecoderLayer._attend_decode_exact``) instead of one padded, masked call over
all rows (``DecoderLayer._attend_decode``'s fused path), so that greedy tokens do not depend
on the batch. There is no switch in the model; this script adds one *in its own process*:
it wraps ``DecoderLayer._attend_decode`` so that, when ``batched`` is on, the metadata's
``decode_lens`` (read only by the exact path's dispatch) is hidden for the call and the
fused call runs. The model's default is not changed.

Whole engine steps (``Engine.step``, one token for each of B rows) are timed, the two paths
interleaved step by step on the same running batch (exact, batched, exact, ... ; the first
two steps, which fill the KV rows, are dropped), medians of wall and CPU ms
(``time.process_time``). Each repetition re-adds the same prompts: after the first, their
prefill is a prefix-cache hit (decode timing does not depend on how the prefix got there;
this keeps the bf16 prefill of 8 x 2048 tokens, minutes on an AVX2 core, out of the run). Two prompt shapes per point: ``equal`` (all B prompts C tokens:
no padding, so the fused call has no mask) and ``ragged`` (lengths spread evenly from C/2
to C: the fused call pads to the longest and masks).

Usage (from the repo root)::

    PYTHONPATH=. nice -n 5 .venv/bin/python docs/results/engine_speed/decode_exact_cost.py \
        --threads 1 --reps 5 --points 8x512,8x2048 --json docs/results/engine_speed/decode_exact_cost.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from bench_engine import CpdSide, _med, _now, _parse_point, _prompts, _since  # noqa: E402

from cpd.engine import model as model_mod  # noqa: E402
from cpd.engine.dtype import resolve_dtype  # noqa: E402
from cpd.engine.engine import EngineRequest  # noqa: E402
from cpd.engine.sampling import SamplingParams  # noqa: E402
from cpd.engine.weights import default_model_dir  # noqa: E402

_state = {"batched": False}
_exact_dispatch = model_mod.DecoderLayer._attend_decode


def _attend_decode(self, q, kv_layer, meta, arena_layer):
    """The model's decode attention, or (``batched`` on) its fused padded call."""
    if not _state["batched"]:
        return _exact_dispatch(self, q, kv_layer, meta, arena_layer)
    lens, meta.decode_lens = meta.decode_lens, None
    try:
        return _exact_dispatch(self, q, kv_layer, meta, arena_layer)
    finally:
        meta.decode_lens = lens


_exact_calls = {"exact": 0, "batched": 0}
_exact_path = model_mod.DecoderLayer._attend_decode_exact


def _counted_exact(self, q, kv_layer, meta, arena_layer):
    _exact_calls["batched" if _state["batched"] else "exact"] += 1
    return _exact_path(self, q, kv_layer, meta, arena_layer)


model_mod.DecoderLayer._attend_decode = _attend_decode  # type: ignore[method-assign]
model_mod.DecoderLayer._attend_decode_exact = _counted_exact  # type: ignore[method-assign]


def _shaped(prompts: list[list[int]], shape: str) -> list[list[int]]:
    """``equal``: as given; ``ragged``: row i cut to C/2 + i * (C/2) / (B-1) tokens."""
    if shape == "equal" or len(prompts) == 1:
        return prompts
    B, C = len(prompts), len(prompts[0])
    return [p[:C // 2 + (i * (C // 2)) // (B - 1)] for i, p in enumerate(prompts)]


def _alternating_steps(cpd: CpdSide, prompts: list[list[int]], steps: int, first: str,
                       tag: str) -> dict[str, list[tuple[float, float]]]:
    """Add ``prompts``, prefill them, then ``2 * steps`` decode steps alternating the two
    paths (``first`` first); the first step of each path is dropped (it fills the KV rows)."""
    e = cpd.engine
    for i, p in enumerate(prompts):
        e.add_request(EngineRequest(f"{tag}-{i}", p, SamplingParams(max_tokens=2 * steps + 2, ignore_eos=True)))
    while any(r.num_computed < r.prompt_len for r in e._running) or e._waiting:
        e.step()
    other = "batched" if first == "exact" else "exact"
    laps: dict[str, list[tuple[float, float]]] = {"exact": [], "batched": []}
    for s in range(2 * steps):
        mode = first if s % 2 == 0 else other
        _state["batched"] = mode == "batched"
        t = _now()
        e.step()
        if s >= 2:
            laps[mode].append(_since(t))
    _state["batched"] = False
    while e.has_unfinished():
        e.step()
    return laps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--points", default="8x512,8x2048")
    ap.add_argument("--shapes", default="equal,ragged")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = resolve_dtype(a.dtype)
    points = [_parse_point(s) for s in a.points.split(",") if s]
    cpd = CpdSide(default_model_dir(), dtype, max(b * n for b, n in points), max(b for b, _ in points))
    res: dict = {"points": {}, "settings": {"dtype": str(dtype).replace("torch.", ""), "threads": a.threads,
                                           "reps": a.reps, "decode_steps": a.steps, "torch": torch.__version__,
                                           "loadavg_start": os.getloadavg()}}
    for b, n in points:
        for shape in a.shapes.split(","):
            laps: dict[str, list[tuple[float, float]]] = {"exact": [], "batched": []}
            ps = _shaped(_prompts(9000 + n, b, n, cpd.vocab), shape)
            cpd.engine.reset_prefix_cache()
            for r in range(a.reps + 1):  # the first repetition warms up (and prefills) and is dropped
                got = _alternating_steps(cpd, ps, a.steps, "exact" if r % 2 == 0 else "batched", f"{shape}{r}")
                if r:
                    for mode in laps:
                        laps[mode] += got[mode]
            _state["batched"] = False
            key = f"{b}x{n}/{shape}"
            e_w, b_w = _med(laps["exact"]) * 1e3, _med(laps["batched"]) * 1e3
            e_c, b_c = _med(laps["exact"], True) * 1e3, _med(laps["batched"], True) * 1e3
            res["points"][key] = {"exact_ms": e_w, "batched_ms": b_w, "exact_cpu_ms": e_c, "batched_cpu_ms": b_c,
                                  "cpu_cost": e_c / b_c - 1, "wall_cost": e_w / b_w - 1,
                                  "loadavg": os.getloadavg()}
            print(f"{key:>14}: per-row exact {e_c:7.1f} CPU ms ({e_w:7.1f} wall)  fused batch {b_c:7.1f} CPU ms "
                  f"({b_w:7.1f} wall)  cost {100 * (e_c / b_c - 1):+.1f} % CPU ({100 * (e_w / b_w - 1):+.1f} % wall)"
                  f"  load {os.getloadavg()[0]:.2f}", flush=True)
    # the switch took effect: the exact path ran in the exact steps (reduced precision only)
    # and never in a batched one
    assert _exact_calls["batched"] == 0 and (_exact_calls["exact"] > 0) == (dtype != torch.float32), _exact_calls
    res["settings"]["exact_path_calls"] = _exact_calls["exact"]
    res["settings"]["loadavg_end"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
