"""The visibility protocol (cpd.store.visibility) on every backend: a write moves ALLOCATED ->
WRITING -> VISIBLE (or DISCARDED) and is announced exactly when it becomes visible; a put
announces each chunk it made visible once, with parent and tokens; eviction, deletion and
invalidation of a corrupt value each announce BlockRemoved for exactly that chunk."""
from __future__ import annotations

import numpy as np
import pytest

from cpd.kv.events import MEDIUM_L3, BlockRemoved, BlockStored
from cpd.store import open_store
from cpd.store.visibility import ChunkState


def _blocks(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, 2, 4, 1, 8)).astype(np.float32) for _ in range(n)]


@pytest.fixture(params=["file", "redis", "cluster"])
def store(request, tmp_path):
    if request.param == "file":
        url = f"file://{tmp_path / 'kv'}"
    elif request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        from tests.e2e.test_redis_cluster import RedisCluster3  # the real 3-node cluster of the cluster tests
        c = RedisCluster3(tmp_path / "cluster")
        c.start(create=True)
        request.addfinalizer(c.stop)
        url = c.url
    events: list = []
    s = open_store(url, chunk_blocks=2, event_sink=events.append)
    s.clear()
    events.clear()
    yield s, events
    s.close()


def test_explicit_write_states_and_one_announcement(store):
    s, events = store
    hs = [101, 102]
    w = s.begin_write(hs, _blocks(2))
    assert w.state is ChunkState.ALLOCATED
    w.write(0.5)
    assert w.state is ChunkState.WRITING and s.lookup_prefix(hs) == 0 and events == []
    w.write(1.0)
    assert s.lookup_prefix(hs) == 0 and events == []  # fully staged, still invisible
    loser = s.begin_write(hs, _blocks(2, seed=1))
    loser.write(1.0)
    assert w.seal() is True and w.state is ChunkState.VISIBLE
    assert events == [BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=0,
                                  medium=MEDIUM_L3)]
    assert loser.seal() is False and loser.state is ChunkState.DISCARDED and len(events) == 1
    partial = s.begin_write([7], _blocks(1))
    partial.write(0.3)
    assert partial.seal() is False and partial.state is ChunkState.DISCARDED and s.lookup_prefix([7]) == 0
    assert w.seal() is False and len(events) == 1  # a second seal changes nothing


def test_put_announces_each_new_chunk_once_and_removals_name_the_chunk(store):
    s, events = store
    hs = [11, 12, 13, 14, 15]
    toks = list(range(5 * 4))
    assert s.put_blocks(hs, _blocks(5), parent_block_hash=10, token_ids=toks, block_size=4) == 5
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.parent_block_hash) for e in stored] == [([11, 12], 10), ([13, 14], 12), ([15], 14)]
    assert stored[1].token_ids == toks[8:16]
    events.clear()
    assert s.delete([14]) == 1
    assert events == [BlockRemoved(block_hashes=[14], medium=MEDIUM_L3)]  # the chunk (14, 2), named by its key
    assert s.lookup_prefix(hs) == 2
