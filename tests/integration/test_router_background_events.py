"""The router's KV-event subscriber under :class:`cpd.router.background.BackgroundTasks` (real ZMQ
sockets, a real publisher, the real prefix index): a subscriber whose batch handler raises is
restarted in-process with fresh sockets, its restart hook runs (the router rebuilds every worker's
entries there) and it goes on feeding the index; one that keeps dying is given up and the verdict
names it; one that hangs stops ticking and the verdict says it made no progress."""
from __future__ import annotations

import json
import os
import threading
import time

from cpd.kv.event_bus import EventPublisher, EventSubscriber
from cpd.kv.events import MEDIUM_L1, BlockStored
from cpd.router.background import KV_EVENTS, BackgroundTasks, RestartBound
from cpd.router.index import PrefixIndex
from conftest import free_port

FAST = RestartBound(initial_backoff_s=0.05, max_backoff_s=0.2, max_restarts=2, stable_after_s=60.0)


def _stored(hashes):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
                       medium=MEDIUM_L1)


def _wait(cond, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class _Setup:
    def __init__(self, tmp_path, on_batch_fails=lambda seq: False, stall_s: float = 60.0):
        self.fault = tmp_path / "fault.json"
        self.bg = BackgroundTasks(FAST, env={"CPD_FAULT_ROUTER_TASK_FILE": str(self.fault)})
        self.bg.register(KV_EVENTS, stall_s)
        self.idx = PrefixIndex()
        self.restarts = []
        port = free_port()
        self.pub = EventPublisher(f"tcp://127.0.0.1:{port}")

        def on_batch(w, seq, b):
            if on_batch_fails(seq):
                raise RuntimeError(f"handler failed on batch {seq}")
            self.idx.apply_batch(w, seq, b)

        self.sub = EventSubscriber(on_batch, on_iteration=lambda: self.bg.tick(KV_EVENTS),
                                   runner=lambda body, stop: self.bg.run_thread(KV_EVENTS, body, stop,
                                                                                on_restart=lambda: self.restarts.append(1)))
        self.sub.add("p0", f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)  # SUB connects (ZMQ slow joiner)

    def publish(self, hashes) -> None:
        for h in hashes:
            self.pub.emit(_stored([h]))
            self.pub.flush()

    def close(self):
        self.pub.close()
        self.sub.close()


def test_a_failing_handler_restarts_the_subscriber_which_feeds_the_index_again(tmp_path):
    s = _Setup(tmp_path, on_batch_fails=lambda seq: seq == 5)
    try:
        s.publish(range(6))  # the last, batch 5, kills the loop
        _wait(lambda: s.bg.report()[KV_EVENTS]["restarts"] == 1, what="no restart")
        assert s.restarts == [1]
        assert s.bg.report()[KV_EVENTS]["last_error"] == "RuntimeError('handler failed on batch 5')"
        time.sleep(0.3)  # the new SUB socket connects
        s.publish(range(100, 110))
        # batches 0-4 applied, 5 failed (lost: the router rebuilds from snapshots in on_restart); the
        # 10 published after the restart all arrive
        _wait(lambda: s.idx.sizes()["L1"] == 5 + 10, what=f"index not fed after the restart: {s.idx.sizes()}")
        assert s.idx.num_gaps == 1  # seq 4 -> 6: the index saw the loss too
        assert s.bg.verdict().healthy and s.sub._thread.is_alive()
    finally:
        s.close()
    assert not s.sub._thread.is_alive()  # close() ends the supervised loop


def test_a_subscriber_that_keeps_dying_is_given_up_and_named(tmp_path):
    s = _Setup(tmp_path)
    try:
        s.fault.write_text(json.dumps({"task": KV_EVENTS, "mode": "raise", "pid": os.getpid()}))
        _wait(lambda: not s.bg.report()[KV_EVENTS]["alive"], what="never given up")
        v = s.bg.verdict()
        assert not v.healthy and v.failing == (KV_EVENTS,)
        assert f"died after {FAST.max_restarts} restarts" in v.reason and "InjectedTaskFault" in v.reason
        _wait(lambda: not s.sub._thread.is_alive(), what="the given-up thread still runs")
    finally:
        s.close()


def test_a_hung_subscriber_is_reported_stalled_and_recovers_when_the_hang_ends(tmp_path):
    s = _Setup(tmp_path, stall_s=0.5)
    try:
        _wait(lambda: s.bg.verdict().healthy)
        s.fault.write_text(json.dumps({"task": KV_EVENTS, "mode": "hang"}))
        _wait(lambda: not s.bg.verdict().healthy, what="a hang was never reported")
        v = s.bg.verdict()
        assert v.failing == (KV_EVENTS,) and "made no progress" in v.reason
        s.publish(range(5))  # queued in the socket meanwhile
        s.fault.unlink()
        _wait(lambda: s.bg.verdict().healthy and s.idx.sizes()["L1"] == 5, what="no recovery after the hang")
        assert s.bg.report()[KV_EVENTS]["restarts"] == 0  # a hang is never restarted in-process
    finally:
        s.close()
