"""A write-through's ``BlockStored(L3)`` reaches the router as soon as the store has the blocks,
not with the worker's flush after its next engine step (real modeled workers, real store, the
workers' real ZMQ event sockets).

A short prompt and a long one arrive together at one prefill worker: the short one finishes in
the first step (its blocks handed to the L3 writer at the step's end) while the long one goes on
for many chunked steps. Before, the short prompt's L3 events waited for the end of the next step
(published in one batch with that step's L1 events): the router priced a prefix it could load
as a recompute for one step time, seconds on a long prefill.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from cpd.kv.event_bus import EventSubscriber
from cpd.kv.events import MEDIUM_L3, BlockStored
from deploy_util import assert_no_leaks, random_prompt, start

SETTINGS = {"engine.executor": "modeled", "engine.hardware": "b200", "engine.model_shape": "llama-3.1-8b",
            "engine.tp": 1, "engine.time_dilation": 20.0, "engine.num_blocks": 2048,
            "handoff.arena_bytes": 16 << 20, "router.write_through": "all", "router.routing_mode": "adaptive"}


@pytest.fixture
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, settings=SETTINGS)
    yield d
    d.stop()


def _post(dep, prompt: list[int]) -> None:
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120).status_code == 200


def test_write_through_events_go_out_when_written_not_after_the_next_step(dep):
    batches: list[tuple[float, list]] = []  # the prefill worker's event batches, with arrival times
    p0 = next(w for w in dep.workers if w["role"] == "prefill")
    sub = EventSubscriber(lambda wid, seq, batch: batches.append((time.monotonic(), list(batch.events))))
    sub.add(p0["worker_id"], p0["events_endpoint"])
    time.sleep(1.0)  # the subscription connects
    try:
        long = threading.Thread(target=_post, args=(dep, random_prompt(8100, 6000)), daemon=True)
        short = threading.Thread(target=_post, args=(dep, random_prompt(8101, 100)), daemon=True)
        long.start()
        short.start()  # both within the first step (budget 512 tokens): the short one ends there
        short.join(60)
        long.join(120)
        time.sleep(0.5)
    finally:
        sub.close()

    def l3(events: list) -> bool:
        return any(isinstance(e, BlockStored) and e.medium == MEDIUM_L3 for e in events)

    def l1(events: list) -> bool:
        return any(isinstance(e, BlockStored) and e.medium != MEDIUM_L3 for e in events)

    first_l3 = next(i for i, (_, events) in enumerate(batches) if l3(events))
    assert not l1(batches[first_l3][1]), "the first L3 announcement waited for the next step's flush"
    later_l1 = [t for t, events in batches[first_l3 + 1:] if l1(events)]
    assert later_l1, "the long prompt's later steps published nothing"  # its L3 event came mid-prefill
    assert_no_leaks(dep)
