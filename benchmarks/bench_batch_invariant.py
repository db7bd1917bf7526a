"""Price of the batch-invariant mode (:mod:`cpd.engine.batch_invariant`) on the real SmolLM2-135M:
the ordinary engine and the batch-invariant one, same dtype, same threads, side by side in one
process, repetitions interleaved (ordinary, invariant, ordinary, ...) so load on a shared machine
hits both alike. Whole engine steps, timed by ``bench_engine.CpdSide`` (512-token step budget and
prefill chunk, the engine's defaults).

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

import torch

from bench_engine import CpdSide
from cpd.engine.dtype import resolve_dtype
from cpd.engine.weights import default_model_dir

CHUNK_TOKENS = 512  # the engine's default step budget and prefill chunk


def _sides(dtype, num_tokens: int, max_seqs: int) -> dict[bool, CpdSide]:
    return {inv: CpdSide(default_model_dir(), dtype, num_tokens, max_seqs, CHUNK_TOKENS, batch_invariant=inv)
            for inv in (False, True)}


def _prompts(n: int, b: int, rep: int) -> list[list[int]]:
    return [[(7 * t + 13 * rep + 101 * i) % 30000 + 10 for t in range(n)] for i in range(b)]


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
    sides = _sides(dtype, max(lens + [b * (c + a.steps + 4) for b, c in shapes]), max([b for b, _ in shapes] + [1]))
    res: dict = {"settings": {"dtype": str(dtype), "threads": a.threads, "reps": a.reps, "steps": a.steps,
                              "model": str(default_model_dir())}, "prefill": {}, "decode": {}}
    for n in lens:
        runs: dict[bool, list] = {False: [], True: []}
        for r in range(a.reps):
            for inv in (False, True):
                runs[inv].append(sides[inv].prefill_s(_prompts(n, 1, r)))
        res["prefill"][str(n)] = _summary(runs, lambda t: n / t, "tok_s")
        print("prefill", n, res["prefill"][str(n)], flush=True)
    for b, c in shapes:
        runs = {False: [], True: []}
        for r in range(a.reps):
            for inv in (False, True):
                steps = sides[inv].decode_step_s(_prompts(c, b, r), a.steps)
                runs[inv].append((sum(w for w, _ in steps) / a.steps, sum(t for _, t in steps) / a.steps))
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
