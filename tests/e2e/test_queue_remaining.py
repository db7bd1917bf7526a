"""With ``router.queue_remaining`` a prefill worker's predicted queue shrinks while its prefill runs
(real router, real modeled worker processes, real HTTP; session 18, issue 11).

The router keeps each worker's ``queued_prefill_s`` (the policy's prediction of the work ahead of a
new request there). It counted a prefill's whole estimate until its first token, so a worker most
of the way through a long prefill looked as busy as one that had not started it
(docs/sim_results/adaptive_grid/session17/). With the option, a prefill that the worker's progress
lines report running counts its estimate less the time since (cpd.policy.prefill_queue).
"""
from __future__ import annotations

import threading
import time

import httpx

from deploy_util import complete, random_prompt, start

K = 10.0  # time dilation: a 1,500-token prefill of the modeled 70B takes a few seconds of wall time
MODELED = {"engine.executor": "modeled", "engine.hardware": "h100", "engine.model_shape": "llama-3.1-70b",
           "engine.tp": 1, "engine.time_dilation": K, "engine.max_num_batched_tokens": 2048,
           "engine.max_prefill_chunk_tokens": 2048, "engine.block_size": 64, "engine.num_blocks": 256,
           "handoff.arena_bytes": 16 << 20}


def _queued_s(url: str) -> float:
    workers = httpx.get(f"{url}/cpd/workers", timeout=10).json()
    return sum(w["queued_prefill_s"] for w in workers.values() if w["role"] != "decode")


def _samples_during_one_prefill(queue_remaining: bool, tiny_model_dir) -> list[float]:
    dep = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1,
                settings={**MODELED, "router.queue_remaining": queue_remaining})
    try:
        t = threading.Thread(target=complete, args=(dep, random_prompt(5, 1500)), kwargs={"max_tokens": 2})
        t.start()
        samples = []
        while t.is_alive():
            samples.append(_queued_s(dep.url))
            time.sleep(0.1)
        t.join()
        assert _queued_s(dep.url) == 0.0  # the first token: nothing queued
        return [s for s in samples if s > 0]
    finally:
        dep.stop()


def test_a_running_prefill_counts_what_remains_of_its_estimate(tiny_model_dir):
    samples = _samples_during_one_prefill(True, tiny_model_dir)
    assert len(samples) >= 5 and samples[0] > 1.0, samples  # the whole estimate while it is queued
    assert min(samples) < samples[0] - 0.5, samples  # then it falls while the worker computes it
    assert all(b <= a + 1e-9 for a, b in zip(samples, samples[1:])), samples


def test_by_default_the_whole_estimate_counts_until_the_first_token(tiny_model_dir):
    samples = _samples_during_one_prefill(False, tiny_model_dir)
    assert len(samples) >= 5 and max(samples) - min(samples) < 1e-9, samples
