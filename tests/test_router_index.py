"""The router's prefix index and the KV-event bus (real ZMQ sockets)."""
from __future__ import annotations

import time

from cpd.kv.event_bus import EventPublisher, EventSubscriber
from cpd.kv.events import MEDIUM_L1, MEDIUM_L2, MEDIUM_L3, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from cpd.router.index import PrefixIndex
from conftest import free_port


def _stored(hashes, medium):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, medium=medium)


def test_match_per_tier_and_worker():
    idx = PrefixIndex()
    idx.apply_batch("p0", 0, KVEventBatch(ts=0, events=[_stored([1, 2, 3], MEDIUM_L1), _stored([1, 2], MEDIUM_L2)]))
    idx.apply_batch("pp0", 0, KVEventBatch(ts=0, events=[_stored([1, 2, 3, 4], MEDIUM_L3)]))
    m = idx.match([1, 2, 3, 4, 5])
    assert m.l1 == {"p0": 3} and m.l2 == {"p0": 2} and m.l3 == 4
    assert idx.match([9, 1]).l3 == 0  # only leading runs count

    idx.apply_batch("p0", 1, KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[2], medium=MEDIUM_L1)]))
    assert idx.match([1, 2, 3]).l1 == {"p0": 1}
    idx.apply_batch("p0", 2, KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    m = idx.match([1, 2, 3])
    assert m.l1 == {} and m.l2 == {} and m.l3 == 3  # clearing a worker's L1/L2 leaves the shared L3


def test_gap_detected_and_old_batches_ignored():
    idx = PrefixIndex()
    assert idx.apply_batch("p0", 0, KVEventBatch(ts=0, events=[_stored([1], MEDIUM_L1)]))
    assert not idx.apply_batch("p0", 2, KVEventBatch(ts=0, events=[_stored([2], MEDIUM_L1)]))  # seq 1 lost
    assert idx.num_gaps == 1
    idx.replace_worker("p0", l1=[7], l2=[], seq=5)
    assert idx.apply_batch("p0", 4, KVEventBatch(ts=0, events=[_stored([8], MEDIUM_L1)]))  # older than snapshot
    assert idx.match([7]).l1 == {"p0": 1} and idx.match([8]).l1 == {}


def test_drop_worker_keeps_l3():
    idx = PrefixIndex()
    idx.apply_batch("p0", 0, KVEventBatch(ts=0, events=[_stored([1], MEDIUM_L1), _stored([1], MEDIUM_L3)]))
    idx.drop_worker("p0")
    m = idx.match([1])
    assert m.l1 == {} and m.l3 == 1


def test_events_over_zmq_reach_index_in_order():
    port = free_port()
    pub = EventPublisher(f"tcp://127.0.0.1:{port}")
    idx = PrefixIndex()
    gaps = []
    sub = EventSubscriber(lambda w, seq, b: idx.apply_batch(w, seq, b) or gaps.append(seq))
    sub.add("p0", f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # SUB connects (ZMQ slow joiner)
    for i in range(20):
        pub.emit(_stored([i], MEDIUM_L1))
        pub.flush()
    deadline = time.time() + 5
    while time.time() < deadline and idx.sizes()["L1"] < 20:
        time.sleep(0.02)
    assert idx.sizes()["L1"] == 20 and not gaps
    pub.close()
    sub.close()
