"""Price of the batch-invariant mode (:mod:`cpd.engine.batch_invariant`) on the real SmolLM2-135M:
the ordinary engine and the batch-invariant one, same dtype, same threads, side by side in one
process, repetitions interleaved (ordinary, invariant, ordinary, ...) so load on a shared machine
hits both alike. Whole engine steps (:meth:`cpd.engine.engine.Engine.step`).

- prefill: one sequence of LEN tokens (chunked as the engine's defaults chunk it), tokens/s;
- decode: B sequences at context C, ms per step (one token each).

Ratios are invariant / ordinary time (> 1: the mode is slower), per repetition; the median and the
range are reported, with CPU seconds (``time.process_time``) beside the wall clock.

Usage::

    .venv/bin/python benchmarks/bench_batch_invariant.py [--dtype auto] [--threads 1] [--reps 3]
        [--prefill 512,2048] [--decode 1x512,8x512,8x2048] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cpd.engine.dtype import resolve_dtype
from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.weights import default_model_dir

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(dtype, invariant: bool, num_tokens: int) -> Engine:
    return Engine(default_model_dir(), num_blocks=num_tokens // 16 + 64, dtype=dtype, batch_invariant=invariant)


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def prefill(engine: Engine, n: int, rep: int) -> tuple[float, float]:
    prompt = [(7 * i + 13 * rep) % 30000 + 10 for i in range(n)]
    return _timed(lambda: engine.generate(prompt, SamplingParams(max_tokens=1, **GREEDY)))


def decode(engine: Engine, b: int, c: int, steps: int, rep: int) -> tuple[float, float]:
    """ms per decode step of ``b`` sequences at context ``c`` (prefilled first, not timed)."""
    for i in range(b):
        prompt = [(7 * t + 13 * rep + 101 * i) % 30000 + 10 for t in range(c)]
        engine.add_request(EngineRequest(f"d{rep}-{i}", prompt, SamplingParams(max_tokens=steps + 2, **GREEDY)))
    while any(r.num_computed < r.prompt_len for r in [*engine._waiting, *engine._running]) or engine._inbox:
        engine.step()
    w, cpu = _timed(lambda: [engine.step() for _ in range(steps)])
    while engine.has_unfinished():
        engine.step()
    return w / steps, cpu / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--decode", default="1x512,8x512,8x2048")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = resolve_dtype(a.dtype)
    lens = [int(x) for x in a.prefill.split(",") if x]
    shapes = [tuple(int(v) for v in x.split("x")) for x in a.decode.split(",") if x]
    biggest = max(lens + [b * (c + a.steps + 4) for b, c in shapes])
    engines = {inv: _engine(dtype, inv, biggest) for inv in (False, True)}
    res: dict = {"settings": {"dtype": str(dtype), "threads": a.threads, "reps": a.reps, "steps": a.steps,
                              "model": str(default_model_dir())}, "prefill": {}, "decode": {}}
    for n in lens:
        runs = {False: [], True: []}
        for r in range(a.reps):
            for inv in (False, True):
                runs[inv].append(prefill(engines[inv], n, r))
        res["prefill"][str(n)] = _summary(runs, lambda t: n / t, "tok_s")
        print("prefill", n, res["prefill"][str(n)], flush=True)
    for b, c in shapes:
        runs = {False: [], True: []}
        for r in range(a.reps):
            for inv in (False, True):
                runs[inv].append(decode(engines[inv], b, c, a.steps, r))
        res["decode"][f"{b}x{c}"] = _summary(runs, lambda t: t * 1e3, "ms")
        print("decode", f"{b}x{c}", res["decode"][f"{b}x{c}"], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def _summary(runs: dict, unit, name: str) -> dict:
    """Medians of each mode (wall and CPU) and the invariant / ordinary time ratio per repetition."""
    out = {}
    for inv, label in ((False, "ordinary"), (True, "invariant")):
        out[f"{label}_{name}"] = round(unit(statistics.median(w for w, _ in runs[inv])), 3)
        out[f"{label}_cpu_{name}"] = round(unit(statistics.median(c for _, c in runs[inv])), 3)
    ratios = [i[1] / o[1] for o, i in zip(runs[False], runs[True])]  # CPU time, invariant / ordinary
    out["cpu_time_ratio"] = round(statistics.median(ratios), 3)
    out["cpu_time_ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    return out


if __name__ == "__main__":
    main()
