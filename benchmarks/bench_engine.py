"""Engine forward speed on the real SmolLM2-135M (CPU by default).

Measures, through :meth:`cpd.engine.engine.Engine.step` (scheduling, metadata,
forward, sampling — the whole step):

* prefill tokens/s for one 512-token prompt (one step, no prefix-cache hit);
* decode step time and tokens/s at batch sizes 1, 4, 16, 32 (prompts of ~200
  tokens with different lengths, greedy, every scheduled sequence decoding).

Where the model has the ``batched_decode`` switch, each measurement is paired:
the old per-sequence attention path (``batched_decode=False``) and the batched
one alternate step by step on the same engine and batch, so load on the shared
machine hits both alike; medians and new/old ratios are printed.

Usage::

    .venv/bin/python benchmarks/bench_engine.py [--batches 1,4,16,32] [--steps 12]
        [--prefill-reps 5] [--prompt-len 200] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.engine.weights import default_model_dir


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def _modes(engine: Engine) -> list[tuple[str, bool | None]]:
    if hasattr(engine.model, "batched_decode"):
        return [("old", False), ("new", True)]
    return [("current", None)]


def _set_mode(engine: Engine, flag: bool | None) -> None:
    if flag is not None:
        engine.model.batched_decode = flag


def _timed_step(engine: Engine) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.step()
    dt = time.perf_counter() - t0
    return dt, sum(len(o.new_token_ids) for o in outs)


def bench_prefill(engine: Engine, prompt_len: int, reps: int, seed0: int) -> dict[str, float]:
    """Median seconds of a step that prefills one ``prompt_len``-token prompt (and samples)."""
    modes = _modes(engine)
    times: dict[str, list[float]] = {m: [] for m, _ in modes}
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    for rep in range(reps + 1):  # first round is warm-up
        order = modes if rep % 2 == 0 else modes[::-1]
        for name, flag in order:
            _set_mode(engine, flag)
            rid = f"pf-{rep}-{name}"
            engine.add_request(EngineRequest(rid, _prompt(seed0 + 1000 * rep + len(name), prompt_len,
                                                          engine.vocab_size), sp))
            dt, n = _timed_step(engine)
            assert n == 1 and not engine.has_unfinished(), "prefill did not finish in one step"
            if rep:
                times[name].append(dt)
    return {m: statistics.median(v) for m, v in times.items()}


def bench_decode(engine: Engine, batch: int, prompt_len: int, steps: int, seed0: int) -> dict[str, float]:
    """Median seconds of a step in which ``batch`` sequences each decode one token."""
    modes = _modes(engine)
    sp = SamplingParams(max_tokens=2 * steps * len(modes) + 8, ignore_eos=True)
    for i in range(batch):
        n = prompt_len - 20 + (41 * i) % 41  # lengths spread over prompt_len ± 20
        engine.add_request(EngineRequest(f"d{batch}-{i}", _prompt(seed0 + i, n, engine.vocab_size), sp))
    started: set[str] = set()
    while len(started) < batch:  # prefill everyone (not timed)
        for o in engine.step():
            started.add(o.request_id)
    times: dict[str, list[float]] = {m: [] for m, _ in modes}
    for rep in range(steps + 1):  # first round is warm-up
        order = modes if rep % 2 == 0 else modes[::-1]
        for name, flag in order:
            _set_mode(engine, flag)
            dt, n = _timed_step(engine)
            assert n == batch, f"expected {batch} decodes in the step, got {n}"
            if rep:
                times[name].append(dt)
    for i in range(batch):
        engine.abort(f"d{batch}-{i}")
    while engine.has_unfinished():
        engine.step()
    return {m: statistics.median(v) for m, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per mode and batch size")
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="write results here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",") if b]
    bs = 16
    need_blocks = max(batches) * ((a.prompt_len + 20 + 4 * a.steps + 16) // bs + 2) + a.prefill_len // bs + 8
    engine = Engine(default_model_dir(), num_blocks=need_blocks, block_size=bs, device=a.device,
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=max(2048, a.prefill_len),
                                                     max_num_seqs=max(64, max(batches)),
                                                     max_prefill_chunk_tokens=a.prefill_len))
    modes = [m for m, _ in _modes(engine)]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {a.device}, modes {modes}")
    res: dict = {"threads": torch.get_num_threads(), "modes": modes, "decode": {}}

    pf = bench_prefill(engine, a.prefill_len, a.prefill_reps, seed0=100)
    res["prefill"] = {m: {"step_s": t, "tok_s": a.prefill_len / t} for m, t in pf.items()}
    print(f"\nprefill {a.prefill_len} tokens:")
    for m, t in pf.items():
        print(f"  {m:8s} {t * 1e3:8.1f} ms  {a.prefill_len / t:8.0f} tok/s")

    print(f"\ndecode (prompts ~{a.prompt_len} tokens), median step over {a.steps} steps:")
    hdr = "  batch " + "".join(f"{m + ' ms':>14s}{m + ' tok/s':>14s}" for m in modes)
    print(hdr + ("     new/old speedup" if len(modes) == 2 else ""))
    for b in batches:
        d = bench_decode(engine, b, a.prompt_len, a.steps, seed0=10_000 * b)
        res["decode"][b] = {m: {"step_s": t, "tok_s": b / t} for m, t in d.items()}
        line = f"  {b:5d} " + "".join(f"{d[m] * 1e3:14.1f}{b / d[m]:14.1f}" for m in modes)
        if len(modes) == 2:
            line += f"     x{d['old'] / d['new']:.2f}"
        print(line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
