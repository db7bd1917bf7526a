"""A finished prefill's handoff does not wait for the steps queued behind it (real router, real
modeled worker processes, real HTTP; ``pd`` 1 + 1).

Found in a live Mooncake replay (docs/results/calibration, session 9): under a queue, requests
spent 2-4 s between the prefill worker's first token and the router's answer. The worker staged
the handoff's KV from a handler thread under the engine lock, which the engine thread takes
again at once for its next step, so the staging waited one or more whole steps. Now the engine
thread stages it right after the step that produced the first token (cpd.worker.runtime).

The setup: a long prompt (8 chunks of 512 tokens, each step ~1 s at this dilation) and a short
one sent just after it; the short one is admitted beside a chunk of the long one and finishes
with it, while the long one keeps the engine stepping. Before the fix the short request's
time outside the worker's prefill call was at least one more step (~1 s); the bound is half a step.
"""
from __future__ import annotations

import threading
import time

from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from deploy_util import assert_no_leaks, complete, random_prompt, routing_record, start, wait_pools_idle

SHAPE, GPU = "llama-3.1-8b", "b200"
DILATION = 100.0  # a 512-token modeled prefill step lasts ~1 s
MODELED = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
           "engine.time_dilation": DILATION, "engine.num_blocks": 1024, "engine.max_prefill_chunk_tokens": 512,
           "engine.max_num_batched_tokens": 1024, "handoff.arena_bytes": 64 << 20}


def _oracle(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    eng = Engine(None, num_blocks=1024, executor=build_modeled_executor(SHAPE, GPU, 1, served_model_dir=model_dir))
    return eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_a_short_request_finished_beside_a_long_one_is_answered_without_waiting_for_its_steps(tiny_model_dir):
    dep = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, settings=MODELED)
    try:
        long_prompt, short_prompt = random_prompt(1, 8 * 512), random_prompt(2, 64)
        out: dict[str, dict] = {}
        t_long = threading.Thread(target=lambda: out.__setitem__("long", complete(dep, long_prompt, 2)))
        t_long.start()
        time.sleep(1.5)  # the long prompt's first chunk is running
        t0 = time.monotonic()
        out["short"] = complete(dep, short_prompt, 2)
        short_wall_s = time.monotonic() - t0
        t_long.join(120)
        rec_short = routing_record(dep, out["short"]["id"])
        rec_long = routing_record(dep, out["long"]["id"])
        outside_s = rec_short["ttft_s"] - rec_short["worker_prefill_s"]
        step_s = rec_long["step_s"] / max(1, rec_long["step_tokens"] / 512)  # one chunk's step, measured
        print(f"short: ttft {rec_short['ttft_s']:.2f} s, worker {rec_short['worker_prefill_s']:.2f} s, outside "
              f"{outside_s:.3f} s, wall {short_wall_s:.2f} s; long ttft {rec_long['ttft_s']:.2f} s; step {step_s:.2f} s")
        assert rec_long["ttft_s"] > rec_short["ttft_s"] + 2 * step_s  # the long one kept the engine stepping
        assert outside_s < 0.5 * step_s, (outside_s, step_s)
        for name, prompt in (("long", long_prompt), ("short", short_prompt)):  # the same pseudo tokens
            assert out[name]["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, 2), name
        wait_pools_idle(dep)
        assert_no_leaks(dep)
    finally:
        dep.stop()
