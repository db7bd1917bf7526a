"""Calibrate a cost model on the real engine: time SmolLM2 steps on this machine, fit, save.

Times :meth:`cpd.engine.engine.Engine.step` (the whole step: scheduling, metadata, forward,
sampling, as a live worker runs it) with the torch executor, then fits the step-time models of
:mod:`cpd.costmodel.calibrated` and writes a profile that
:class:`~cpd.costmodel.calibrated.CalibratedCostModel` loads.

Grid:

* prefill: one chunk of ``n`` new tokens on ``p`` tokens already in L1 (``p + n`` within the
  model's context). The ``p``-token prefixes are computed once and stay cached; each timed
  request is ``prefix + n fresh random tokens`` (the step's output must report exactly ``p``
  L1 tokens, else the point is discarded and re-timed);
* decode: ``b`` sequences of ``c`` context each, one token each per step; the ``b`` prompts
  share a ``c - 16``-token prefix (so the setup costs one prefill of it) and differ in their last
  16 tokens; the attention still gathers ``c`` tokens per sequence;
* transfers: a prefix of ``p`` tokens loaded from L2 (host pool) or L3 (file store under
  /dev/shm) into L1 plus 16 new tokens, minus the same step with the prefix in L1, per byte;
  ``NIC`` (the handoff) as twice the time of exporting a request's KV (prefill side copies it
  out, decode side copies it in).

Measurements are interleaved: every round visits every point once in a shuffled order; the
profile keeps every sample, the load average at each, and the median per point (what is fitted).
Clock (``--clock``): by default the step's *thread CPU time* is fitted, not its wall time: on a
shared machine the wall time of a 1-thread step includes the time other processes held the
core, the thread's CPU time does not (it still includes their cache and memory-bandwidth
interference). Both are recorded per point (``wall_t_s``, ``cpu_t_s``). With more than one
torch thread only ``--clock wall`` is meaningful (the others' CPU time is not counted).

Usage::

    .venv/bin/python benchmarks/calibrate_engine.py --threads 1 --out cpd/costmodel/profiles/smollm2-135m-vm-t1.json
        [--model DIR] [--dtype auto] [--rounds 3] [--prefill-n 16,64,...] [--prefill-p 0,512,...]
        [--decode-b 1,2,...] [--decode-c 128,...] [--decode-steps 6] [--no-transfers]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cpd.costmodel.calibrated import FORMAT, fit_profile
from cpd.costmodel.model_shapes import load_config
from cpd.engine.dtype import resolve_dtype
from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.engine.weights import default_model_dir

BLOCK = 16
TAIL = 16  # distinct tokens per decode prompt / new tokens of a transfer point


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


class Timer:
    """Runs requests through one engine and times steps."""

    def __init__(self, engine: Engine, seed: int):
        self.e = engine
        self.rng = random.Random(seed)
        self.k = 0
        self.vocab = engine.vocab_size

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, self.vocab - 10) for _ in range(n)]

    def _rid(self) -> str:
        self.k += 1
        return f"c{self.k}"

    def run(self, prompt: list[int], max_tokens: int = 1, **kw) -> None:
        """Run one request to completion (untimed)."""
        self.e.add_request(EngineRequest(self._rid(), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                         **kw))
        while self.e.has_unfinished():
            self.e.step()

    def prefill_step_s(self, prompt: list[int]) -> tuple[tuple[float, float], dict[str, int]]:
        """``(wall, thread CPU)`` seconds of the one step that computes ``prompt``'s uncached
        part, and the prompt tokens it found cached per tier (``{}`` when the request did not
        finish in that one step)."""
        self.e.add_request(EngineRequest(self._rid(), prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        t, c = time.perf_counter(), time.thread_time()
        outs = self.e.step()
        dt = (time.perf_counter() - t, time.thread_time() - c)
        while self.e.has_unfinished():
            self.e.step()
        got = next((o.num_cached_tokens_by_tier for o in outs if o.num_cached_tokens_by_tier is not None), None)
        return dt, (dict(got) if outs and outs[0].finished and got is not None else {})

    def decode_steps_s(self, prompts: list[list[int]], steps: int) -> list[tuple[float, float]]:
        e = self.e
        for p in prompts:
            e.add_request(EngineRequest(self._rid(), p, SamplingParams(max_tokens=steps + 2, ignore_eos=True)))
        while e._waiting or any(r.num_computed < r.prompt_len for r in e._running):
            e.step()
        if len(e._running) != len(prompts):
            raise RuntimeError("decode setup: not every sequence is running (raise num_blocks / max_num_seqs)")
        out = []
        for _ in range(steps):
            t, c = time.perf_counter(), time.thread_time()
            e.step()
            out.append((time.perf_counter() - t, time.thread_time() - c))
        while e.has_unfinished():
            e.step()
        return out


def measure_grid(timer: Timer, n_list: list[int], p_list: list[int], b_list: list[int], c_list: list[int],
                 rounds: int, steps: int, max_ctx: int, clock: str, log) -> list[dict]:
    """Interleaved rounds over the prefill and decode points; per point the wall and thread-CPU
    samples and medians; ``t_s`` (what is fitted) is the ``clock`` one."""
    prefixes = {p: timer.tokens(p) for p in p_list if p > 0}
    for p, toks in prefixes.items():  # compute each prefix once; later requests hit it in L1
        timer.run(toks)
    points: dict[tuple, dict] = {}
    for p in p_list:
        for n in n_list:
            if p + n < max_ctx:  # room for the sampled token
                points[("prefill", n, p)] = {"kind": "prefill", "n": n, "p": p, "wall_samples_s": [],
                                             "cpu_samples_s": [], "loadavg": []}
    for b in b_list:
        for c in c_list:
            points[("decode", b, c)] = {"kind": "decode", "b": b, "c": c, "wall_samples_s": [], "cpu_samples_s": [],
                                        "loadavg": []}
    keys = list(points)
    for rnd in range(rounds):
        random.Random(rnd).shuffle(keys)
        for key in keys:
            pt = points[key]
            if key[0] == "prefill":
                _, n, p = key
                for _ in range(3):
                    dt, got = timer.prefill_step_s(prefixes.get(p, []) + timer.tokens(n))
                    if got.get("L1") == p:
                        break
                    for q, toks in prefixes.items():  # a prefix was evicted: recompute them all
                        timer.run(toks)
                else:
                    raise RuntimeError(f"prefill n={n} p={p}: prefix not cached after 3 tries ({got})")
                pt["wall_samples_s"].append(dt[0])
                pt["cpu_samples_s"].append(dt[1])
            else:
                _, b, c = key
                shared = timer.tokens(c - TAIL)
                timer.run(shared)  # cached first: the b prompts then compute only their tails
                ds = timer.decode_steps_s([shared + timer.tokens(TAIL) for _ in range(b)], steps)
                pt["wall_samples_s"].append(statistics.median(x[0] for x in ds))
                pt["cpu_samples_s"].append(statistics.median(x[1] for x in ds))
            pt["loadavg"].append(round(os.getloadavg()[0], 2))
        log(f"round {rnd + 1}/{rounds} done, load {os.getloadavg()[0]:.2f}")
    out = []
    for pt in points.values():
        pt["wall_t_s"] = statistics.median(pt["wall_samples_s"])
        pt["cpu_t_s"] = statistics.median(pt["cpu_samples_s"])
        pt["t_s"] = pt[f"{clock}_t_s"]
        out.append(pt)
    return out


def measure_transfers(model_dir, dtype, kv_tok: int, p_list: list[int], rounds: int, clock: str, log) -> dict:
    """L2 / L3 / NIC bandwidths (module docstring); each figure a median over ``rounds``."""
    from cpd.store import open_store
    from cpd.store.connector import L3Connector

    sched = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=8, max_prefill_chunk_tokens=4096,
                            block_size=BLOCK)
    tmp = tempfile.mkdtemp(prefix="cpd-calib-l3-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    samples: dict[str, list[tuple[int, float]]] = {"L2": [], "L3": [], "NIC": []}
    try:
        conn = L3Connector(open_store(f"file://{tmp}"), write_async=False)
        # L1 holds one prefix (+ the new tokens); the other prefix evicts it into L2
        pmax = max(p_list)
        nb = (pmax + TAIL) // BLOCK + 2  # the other prefix (pmax + TAIL tokens) leaves one block free
        e = Engine(model_dir, num_blocks=nb, block_size=BLOCK, host_kv_bytes=4 * (pmax + 64) * kv_tok,
                   scheduler_config=sched, dtype=dtype, connector=conn)
        t = Timer(e, 7)
        for rnd in range(rounds):
            for p in p_list:
                a, other = t.tokens(p), t.tokens(pmax + TAIL)
                t.run(a, write_through=True)
                base, g1 = t.prefill_step_s(a + t.tokens(TAIL))
                t.run(other)  # evicts a's blocks (all but at most one) from L1 into L2
                l2, g2 = t.prefill_step_s(a + t.tokens(TAIL))
                e.reset_prefix_cache()  # L1 and L2 gone; a's blocks remain in L3
                l3, g3 = t.prefill_step_s(a + t.tokens(TAIL))
                # the step computes TAIL tokens on p in every case; the difference is the load
                if g1.get("L1") != p or g2.get("L1", 0) + g2.get("L2", 0) != p or not g2.get("L2") \
                        or g3.get("L3") != p:
                    log(f"transfer p={p}: tiers not as planned ({g1}, {g2}, {g3}); skipped")
                    continue
                k = 0 if clock == "wall" else 1
                samples["L2"].append((g2["L2"], l2[k] - base[k]))
                samples["L3"].append((p, l3[k] - base[k]))
                e.add_request(EngineRequest(f"x{rnd}-{p}", a, SamplingParams(max_tokens=2, ignore_eos=True),
                                            mode="prefill"))
                while e.has_unfinished():
                    e.step()
                clk = time.perf_counter if clock == "wall" else time.thread_time
                t0 = clk()
                e.export_kv(f"x{rnd}-{p}")
                samples["NIC"].append((p, 2 * (clk() - t0)))
                e.release(f"x{rnd}-{p}")
                e.reset_prefix_cache()
            log(f"transfers round {rnd + 1}/{rounds}, load {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict[str, dict] = {}
    for tier, ss in samples.items():
        if not ss:
            continue
        per_tok = statistics.median(max(dt, 1e-7) / p for p, dt in ss)
        out[tier] = {"bytes_per_s": kv_tok / per_tok, "latency_s": 0.0,
                     "samples": [{"p": p, "dt_s": dt} for p, dt in ss]}
    return out


def refit(src: Path, clock: str, out: Path) -> None:
    """``src``'s points refitted on ``clock`` (``t_s`` := each point's ``{clock}_t_s``)."""
    doc = json.loads(src.read_text())
    for pt in doc["points"]:
        pt["t_s"] = pt[f"{clock}_t_s"]
    doc.update(fit_profile(doc["points"]))
    doc["method"] = {**doc["method"], "clock": clock, "refit_from": str(src),
                     "what": f"median over rounds of Engine.step() {clock} time, refitted from {src.name}"}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for k in ("prefill", "decode"):
        f = doc[k]["fit"]
        print(f"{k}: {doc[k]['coef']}  R2 {f['r2']:.4f}  rms rel {f['rms_rel_error']:.3f}  max rel {f['max_rel_error']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF Llama dir (default: the converted SmolLM2-135M)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a live worker's --torch-threads)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-n", type=_ints, default=_ints("16,64,128,256,512,1024,2048"))
    ap.add_argument("--prefill-p", type=_ints, default=_ints("0,512,2048,4096,6144"))
    ap.add_argument("--decode-b", type=_ints, default=_ints("1,2,4,8,16,32"))
    ap.add_argument("--decode-c", type=_ints, default=_ints("128,512,1024,2048"))
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--transfer-p", type=_ints, default=_ints("2048,4096"))
    ap.add_argument("--no-transfers", action="store_true")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="what is fitted: the step's thread CPU time (default: robust to other processes "
                         "on a shared machine; equals wall time on an idle core with 1 thread) or wall time")
    ap.add_argument("--refit", metavar="PROFILE", default=None,
                    help="measure nothing: refit PROFILE's points on --clock (e.g. a wall-time profile from a "
                         "CPU-time run; the transfer figures are kept as measured) and write --out")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.refit:
        refit(Path(a.refit), a.clock, Path(a.out))
        return
    if a.threads > 1 and a.clock == "cpu":
        ap.error("--clock cpu counts the calling thread only: use --clock wall with --threads > 1")
    torch.set_num_threads(a.threads)
    model_dir = Path(a.model or default_model_dir())
    dtype = resolve_dtype(a.dtype)
    shape = load_config(model_dir / "config.json")
    max_ctx = shape.max_context

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    load0 = os.getloadavg()
    log(f"threads {a.threads}, dtype {dtype}, torch {torch.__version__}, load {load0}")
    pmax = max(a.prefill_p) + max(a.prefill_n)
    nb = (sum(a.prefill_p) + 2 * max(a.prefill_n) + max(a.decode_b) * (max(a.decode_c) + a.decode_steps + 2
                                                                          + BLOCK)) // BLOCK + 64
    sched = SchedulerConfig(max_num_batched_tokens=max(pmax, max(a.decode_b) * TAIL, 512),
                            max_num_seqs=max(a.decode_b), max_prefill_chunk_tokens=max(a.prefill_n),
                            block_size=BLOCK)
    engine = Engine(model_dir, num_blocks=nb, block_size=BLOCK, scheduler_config=sched, dtype=dtype)
    timer = Timer(engine, 0)
    timer.run(timer.tokens(256))  # warm-up (first-call allocations)
    t0 = time.time()
    points = measure_grid(timer, a.prefill_n, a.prefill_p, a.decode_b, a.decode_c, a.rounds, a.decode_steps,
                          max_ctx, a.clock, log)
    del engine, timer
    kv_dtype_bytes = torch.tensor([], dtype=dtype).element_size()
    kv_tok = shape.kv_bytes_per_token(kv_dtype_bytes)
    transfer = {} if a.no_transfers else measure_transfers(model_dir, dtype, kv_tok, a.transfer_p, a.rounds,
                                                                   a.clock, log)
    fit = fit_profile(points)
    model = {"name": str(json.loads((model_dir / "config.json").read_text()).get("cpd_model_id", model_dir.name)),
             **{k: getattr(shape, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                               "num_kv_heads", "head_dim", "vocab_size", "max_context",
                                               "tie_word_embeddings")},
             "kv_dtype_bytes": kv_dtype_bytes}
    doc = {"format": FORMAT, "model": model,
           "machine": {"host": socket.gethostname(), "cpu": cpu_model(), "logical_cpus": os.cpu_count(),
                       "threads": a.threads, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
                       "python": platform.python_version(), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                       "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                       "wall_s": round(time.time() - t0, 1)},
           "method": {"rounds": a.rounds, "decode_steps": a.decode_steps, "block_size": BLOCK, "clock": a.clock,
                      "what": f"median over rounds of Engine.step() {a.clock} time (interleaved, shuffled order); "
                              "points also carry the other clock's samples"},
           **fit, "transfer": transfer, "points": points}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for k in ("prefill", "decode"):
        f = fit[k]["fit"]
        log(f"{k}: {fit[k]['coef']}  R2 {f['r2']:.4f}  rms rel {f['rms_rel_error']:.3f}  max rel "
            f"{f['max_rel_error']:.3f}")
    log(f"transfer: { {t: round(v['bytes_per_s'] / 1e9, 2) for t, v in transfer.items()} } GB/s")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
