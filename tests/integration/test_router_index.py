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
    assert m.l1 == {"p0": 3} and m.l2 == {} and m.l3 == 4  # L2 holds nothing past the L1 run
    assert idx.match([9, 1]).l3 == 0  # only leading runs count

    idx.apply_batch("p0", 1, KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[2], medium=MEDIUM_L1)]))
    assert idx.match([1, 2, 3]).l1 == {"p0": 1}
    idx.apply_batch("p0", 2, KVEventBatch(ts=0, events=[AllBlocksCleared()]))
    m = idx.match([1, 2, 3, 4])
    assert m.l1 == {} and m.l2 == {} and m.l3 == 4  # clearing a worker's L1/L2 leaves the shared L3


def test_gap_detected_and_old_batches_ignored():
    idx = PrefixIndex()
    assert idx.apply_batch("p0", 0, KVEventBatch(ts=0, events=[_stored([1], MEDIUM_L1)]))
    assert not idx.apply_batch("p0", 2, KVEventBatch(ts=0, events=[_stored([2], MEDIUM_L1)]))  # seq 1 lost
    assert idx.num_gaps == 1
    idx.replace_worker("p0", l1=[7], l2=[], seq=5)
    assert idx.apply_batch("p0", 4, KVEventBatch(ts=0, events=[_stored([8], MEDIUM_L1)]))  # older than snapshot
    assert idx.match([7]).l1 == {"p0": 1} and idx.match([8]).l1 == {}


def test_l3_events_older_than_an_l1_l2_snapshot_are_kept():
    """The snapshot (``/kv_snapshot``) holds L1/L2 only: a batch it overtook still brings its
    L3 announcements and removals, in the worker's order."""
    idx = PrefixIndex()
    idx.replace_worker("p0", l1=[7], l2=[], seq=5)
    idx.apply_batch("p0", 4, KVEventBatch(ts=0, events=[_stored([8], MEDIUM_L1), _stored([8, 9], MEDIUM_L3),
                                                         _stored([10], MEDIUM_L3)]))
    idx.apply_batch("p0", 5, KVEventBatch(ts=0, events=[BlockRemoved(block_hashes=[10], medium=MEDIUM_L3)]))
    assert idx.match([8]).l1 == {} and idx.match([8, 9]).l3 == 2 and idx.match([10]).l3 == 0


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


# --- the L3 view converges to what the store can serve (issue 7 §6) -------------------------

def _l3_batch(*events):
    return KVEventBatch(ts=0, events=list(events))


def test_l3_view_matches_at_chunk_granularity_like_the_store(tmp_path):
    """Per-block indexing promised blocks in the middle of a chunk that the store cannot serve
    for a request ending there; the view must answer exactly what ``lookup_prefix`` answers."""
    import numpy as np

    from cpd.store import open_store
    events = []
    store = open_store(f"file://{tmp_path / 'kv'}", chunk_blocks=4, event_sink=events.append)
    chain = list(range(100, 110))  # 10 blocks -> chunks [0-3] [4-7] [8-9]
    store.put_blocks(chain, [np.zeros((2, 2, 16, 1, 4), np.float32)] * 10)
    idx = PrefixIndex()
    idx.apply_batch("pp0", 0, _l3_batch(*events))
    other = chain[:6] + [7, 8, 9]  # shares 6 blocks, then diverges
    for hs, cap in [(chain, None), (chain, 9), (chain, 8), (other, None), (chain[:5], None), ([1] + chain, None)]:
        want = store.lookup_prefix(hs[:cap] if cap is not None else hs)
        assert idx.match(hs, l3_max_blocks=cap).l3 == want, (hs, cap)
    assert idx.match(chain, l3_max_blocks=9).l3 == 8  # exact prompt: last chunk is beyond the cap
    assert idx.match(other).l3 == 4
    store.close()


def test_l3_corrupt_middle_chunk_observation_removes_only_that_chunk():
    idx = PrefixIndex()
    chain = list(range(1, 13))
    idx.apply_batch("pp0", 0, _l3_batch(*[_stored(chain[s:s + 4], MEDIUM_L3) for s in (0, 4, 8)]))
    assert idx.match(chain).l3 == 12
    # a worker read the chain: the middle chunk was corrupt (deleted), the others fine
    idx.observe_l3(chain, present=[(4, 4), (12, 4)], gone=[(8, 4)])
    assert idx.match(chain).l3 == 4  # valid leading chunk kept
    assert idx.l3_chunks() == [(4, 4), (12, 4)]  # valid trailing chunk kept too
    # the chunk is rewritten (a writer announces it): the whole prefix is back
    idx.apply_batch("pp0", 1, _l3_batch(_stored(chain[4:8], MEDIUM_L3)))
    assert idx.match(chain).l3 == 12


def test_l3_observation_relearns_and_removal_semantics():
    idx = PrefixIndex()
    # an index that lost everything relearns what a worker found
    idx.observe_l3([1, 2, 3, 4], present=[(2, 2), (4, 2)])
    assert idx.match([1, 2, 3, 4]).l3 == 4
    # a removal names one chunk: only that chunk goes, a different chunk ending at 4 stays
    idx.observe_l3([4], present=[(4, 2), (4, 4)])
    idx.apply_batch("pp0", 0, _l3_batch(BlockRemoved(block_hashes=[1, 2, 3, 4], medium=MEDIUM_L3)))
    assert idx.l3_chunks() == [(2, 2), (4, 2)]
    # a removal whose size is unknown (only the last hash named) drops every chunk ending there
    idx.apply_batch("pp0", 1, _l3_batch(BlockRemoved(block_hashes=[4], medium=MEDIUM_L3)))
    assert idx.l3_chunks() == [(2, 2)] and idx.match([1, 2, 3, 4]).l3 == 2
    # a per-block publisher: events cut into 1-block chunks
    pb = PrefixIndex(l3_chunk_blocks=1)
    pb.apply_batch("x", 0, _l3_batch(_stored([1, 2, 3], MEDIUM_L3)))
    assert pb.match([1, 2, 9]).l3 == 2


def test_l3_resync_replays_events_that_arrive_during_the_listing():
    idx = PrefixIndex()
    idx.apply_batch("pp0", 0, _l3_batch(_stored([1, 2], MEDIUM_L3)))
    idx.begin_l3_resync()
    # while the listing is taken: chunk (4, 2) appears, chunk (2, 2) is removed
    idx.apply_batch("pp0", 1, _l3_batch(_stored([3, 4], MEDIUM_L3), BlockRemoved(block_hashes=[1, 2], medium=MEDIUM_L3)))
    idx.finish_l3_resync([(2, 2), (6, 2)])  # the listing saw the old state of (2, 2) and also (6, 2)
    assert idx.l3_chunks() == [(4, 2), (6, 2)]
    idx.begin_l3_resync()
    idx.abort_l3_resync()  # a failed listing changes nothing
    assert idx.l3_chunks() == [(4, 2), (6, 2)]


def test_l3_observation_spares_chunks_learned_after_the_probe():
    """A probe that saw nothing, reported after the request's own write-through was announced,
    must not remove the fresh chunks (only chunks learned before the probe may go)."""
    t = [0.0]
    from cpd.router.l3_view import L3View
    v = L3View(clock=lambda: t[0])
    v.stored([1, 2])  # learned at t=0
    t[0] = 10.0
    v.stored([3, 4])  # learned at t=10, after the probe began (t=5)
    v.observe([2, 4], present=[], since=5.0)
    assert v.keys() == [(4, 2)]
    v.observe([4], present=[], gone=[(4, 2)], since=11.0)  # a later probe: it is gone
    assert v.keys() == []
    # a probe that saw a chunk, then a read that found it corrupt (two observations of one
    # request, same `since`): the first must not re-date the chunk so that the second spares it
    v.stored([5, 6])  # learned at t=10
    t[0] = 20.0
    v.observe([6], present=[(6, 2)], since=15.0)
    v.observe([6], present=[], gone=[(6, 2)], since=15.0)
    assert v.keys() == []
