"""L3 store: capacity limit with LRU eviction (file + redis), Redis's own evictions turned into
events, chunked batches in one round trip, and store faults (slow store, restart)."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from cpd.kv.events import BlockRemoved
from cpd.store import StoreTimeout, open_store, parse_size
from cpd.store.connector import L3Connector

from conftest import DelayProxy, RedisServer

SHAPE = (2, 2, 16, 2, 8)


def rand_blocks(n, seed=0, shape=SHAPE):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def removed(ev):
    return [e for e in ev if isinstance(e, BlockRemoved)]


@pytest.fixture(params=["file", "redis", "mem"])
def base_url(request, tmp_path):
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    if request.param == "mem":
        return f"mem://{tmp_path.name}"
    return f"file://{tmp_path / 'kv'}"


def test_parse_size_and_url_options(base_url):
    assert parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29 and parse_size("4096") == 4096
    s = open_store(f"{base_url}?capacity_bytes=2M&chunk_blocks=4")
    assert s.capacity_bytes == 2 << 20 and s.chunk_blocks == 4
    s.close()


def test_capacity_lru_evicts_and_publishes(base_url):
    blocks = rand_blocks(2)
    probe = open_store(base_url, chunk_blocks=2)
    probe.put_blocks([1, 2], blocks)
    one = probe.stats().bytes  # bytes of one 2-block chunk
    probe.clear()
    probe.close()
    ev = []
    s = open_store(f"{base_url}?capacity_bytes={3 * one}", chunk_blocks=2, event_sink=ev.append)
    other = open_store(f"{base_url}?capacity_bytes={3 * one}", chunk_blocks=2)  # a second process
    for i in range(3):
        assert s.put_blocks([10 * i + 1, 10 * i + 2], blocks) == 2
        time.sleep(0.002)  # distinct mtimes for the file backend
    assert s.stats().bytes == 3 * one and not removed(ev)
    assert other.get_blocks([1, 2]) is not None  # chunk 0 used recently (by another client)
    time.sleep(0.002)
    s.put_blocks([31, 32], blocks)  # over capacity: the LRU chunk (chunk 1) goes
    assert s.lookup_prefix([1, 2]) == 2 and s.lookup_prefix([11, 12]) == 0
    assert s.lookup_prefix([21, 22]) == 2 and s.lookup_prefix([31, 32]) == 2
    rm = removed(ev)
    assert len(rm) == 1 and set(rm[0].block_hashes) == {11, 12} and rm[0].medium == "L3"
    st = s.stats()
    assert st.bytes <= 3 * one and st.evicted == 1
    # explicit evict_to: everything but the most recent chunk
    ev.clear()
    assert s.evict_to(one) == 2
    assert {h for e in removed(ev) for h in e.block_hashes} == {1, 2, 21, 22}
    assert s.lookup_prefix([31, 32]) == 2 and s.stats().num_chunks == 1
    # a burst bigger than the capacity keeps only what fits
    ev.clear()
    hs = list(range(100, 120))
    s.put_blocks(hs, rand_blocks(20))
    assert s.stats().bytes <= 3 * one
    gone = {h for e in removed(ev) for h in e.block_hashes}
    assert all(s.lookup_prefix([h]) == 0 for h in gone if h >= 100)
    s.close()
    other.close()


@pytest.mark.parametrize("policy", ["volatile-lru", "allkeys-lru"])
def test_redis_server_evictions_become_events(tmp_path, policy):
    srv = RedisServer(tmp_path, ("--maxmemory", "2mb", "--maxmemory-policy", policy))
    srv.start()
    try:
        ev = []
        ttl = "&chunk_ttl_s=3600" if policy.startswith("volatile") else ""
        s = open_store(f"{srv.url}?watch_evictions=1{ttl}", chunk_blocks=2, event_sink=ev.append)
        assert s._watcher.wait_ready(5)
        assert "e" in s.r.config_get("notify-keyspace-events")["notify-keyspace-events"]
        blk = rand_blocks(2, shape=(8, 256))  # 2 x 8 KiB per chunk, ~1 MiB of room
        chains = [[1000 + 10 * i, 1001 + 10 * i] for i in range(150)]
        stored = [hs for hs in chains if s.put_blocks(hs, blk) == 2]
        assert len(stored) > 100
        deadline = time.time() + 5
        while time.time() < deadline:
            gone = {h for e in removed(ev) for h in e.block_hashes}
            present = {h for hs in stored for h in hs if s.lookup_prefix(hs) == 2}
            if all(hs[1] in gone or hs[1] in present for hs in stored):
                break
            time.sleep(0.05)
        evicted = int(s.r.info("stats")["evicted_keys"])
        assert evicted > 0 and gone, "no BlockRemoved for server-side evictions"
        assert all(hs[1] in gone or hs[1] in present for hs in stored)  # each eviction reported
        assert not gone & present  # never a removal of something still visible
        if policy.startswith("volatile"):
            # only chunks are evictable; the bookkeeping survives and names every block
            assert all(s.r.exists(k) for k in s.lru.keys[:2])
            assert all((hs[0] in gone) == (hs[1] in gone) for hs in stored)
            assert s.used_bytes() >= s.stats().bytes  # a chunk evicted before its accounting lingers
        assert s._watcher.seen >= 1 and s.stats().evicted >= 1
        s.close()
    finally:
        srv.stop()


def test_many_chunks_one_round_trip(redis_server):
    """Reads and writes of many chunks are pipelined: one round trip per batch."""
    s = open_store(redis_server.url, chunk_blocks=4)
    hs, blocks = list(range(1, 41)), rand_blocks(40)
    before = int(s.r.info("stats")["total_commands_processed"])
    assert s.put_blocks(hs, blocks, skip_existing=False) == 40
    after_put = int(s.r.info("stats")["total_commands_processed"])
    assert after_put - before == 10 + 1  # 10 SETs (+ the INFO)
    assert [a.tobytes() for a in s.get_blocks(hs)] == [b.tobytes() for b in blocks]
    # connections opened: the pool reuses one connection for all of this
    assert int(s.r.info("clients")["connected_clients"]) == 1
    s.close()


def test_slow_store_times_out_and_connector_falls_back(redis_server):
    proxy = DelayProxy(redis_server.port)
    try:
        s = open_store(f"redis://127.0.0.1:{proxy.port}?timeout_s=0.2")
        hs, blocks = [1, 2, 3], rand_blocks(3)
        c = L3Connector(s, write_async=False)
        c.save(hs, None, [], blocks)
        assert c.lookup(hs) == 3
        proxy.delay_s = 3.0  # far beyond the 0.2 s timeout, so a hang cannot pass the bounds below
        for op in (lambda: s.lookup_prefix(hs), lambda: s.get_blocks(hs)):
            t0 = time.monotonic()
            with pytest.raises(StoreTimeout):
                op()
            assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        assert c.lookup(hs) == 0 and c.load(hs) is None
        c.save([9], None, [], rand_blocks(1))
        assert time.monotonic() - t0 < 2.5
        assert c.fallback_counts["timeout"] == 3
        proxy.delay_s = 0.0
        time.sleep(3.2)  # let delayed bytes drain
        assert c.lookup(hs) == 3 and c.load(hs) is not None  # recovered on its own
    finally:
        proxy.close()


def test_server_restart_connector_recovers(tmp_path):
    srv = RedisServer(tmp_path)
    srv.start()
    try:
        s = open_store(f"{srv.url}?capacity_bytes=64M", chunk_blocks=2)
        c = L3Connector(s, write_async=True)
        hs, blocks = [1, 2, 3, 4], rand_blocks(4)
        c.save(hs, None, [], blocks)
        assert c.flush(5) and c.lookup(hs) == 4
        srv.stop()
        assert c.lookup(hs) == 0 and c.load(hs) is None
        c.save(hs, None, [], blocks)
        assert c.flush(5)
        assert c.fallback_counts["unavailable"] == 3
        srv.start()  # same port, empty (no persistence)
        assert c.lookup(hs) in (0, 4)  # first call may land on a dead pooled connection
        c.save(hs, None, [], blocks)
        assert c.flush(5)
        assert c.lookup(hs) == 4
        assert [a.tobytes() for a in c.load(hs)] == [b.tobytes() for b in blocks]
        assert s.used_bytes() == s.stats().bytes  # bookkeeping rebuilt by the writes
        c.close()
    finally:
        srv.stop()


def test_file_capacity_sees_other_writers(tmp_path):
    """Another process's writes are noticed at the next rescan (``evict_interval_s``)."""
    url = f"file://{tmp_path / 'kv'}"
    blocks = rand_blocks(1)
    a = open_store(f"{url}?capacity_bytes=1&evict_interval_s=0", chunk_blocks=1)
    b = open_store(url, chunk_blocks=1)  # no capacity: never evicts
    for h in range(10):
        b.put_blocks([h], blocks)
    assert b.stats().num_chunks == 10
    ev = []
    a.event_sink = ev.append
    a.put_blocks([99], blocks)
    assert a.stats().num_chunks == 0  # capacity 1 byte: nothing fits
    assert {h for e in removed(ev) for h in e.block_hashes} == set(range(10)) | {99}
    assert not [n for n in os.listdir(tmp_path / "kv") if n.endswith(".kv")]


# --- a default capacity sized from the machine (issue 7 §8) --------------------------------

def test_default_capacity_sizing_rule():
    from cpd.store import capacity as c
    G = 1 << 30
    assert c.default_capacity_bytes(10 * G, 2 * G, 64 * G, ram_backed=False) == 6 * G  # half of free + held
    assert c.default_capacity_bytes(10 * G, 2 * G, 16 * G, ram_backed=True) == 4 * G  # tmpfs: a quarter of RAM
    assert c.default_capacity_bytes(0, 0, 0, ram_backed=False) == c.FLOOR_BYTES
    assert c.default_capacity_bytes(1 << 50, 0, 0, ram_backed=False) == c.CAP_BYTES
    # what the store already holds counts, so a process opening a full store gets the same figure
    assert c.default_capacity_bytes(6 * G, 4 * G, 64 * G, False) == c.default_capacity_bytes(10 * G, 0, 64 * G, False)
    assert c.fs_type("/proc") == "proc"


def test_default_file_store_is_bounded_and_overridable(tmp_path):
    from cpd.store.capacity import machine_default_capacity_bytes
    root = tmp_path / "kv"
    s = open_store(f"file://{root}")
    assert s.capacity_bytes == machine_default_capacity_bytes(str(root)) > 0
    s.close()
    assert open_store(f"file://{root}?capacity_bytes=0").capacity_bytes == 0  # unlimited only if asked
    assert open_store(f"file://{root}?capacity_bytes=1M").capacity_bytes == 1 << 20
    assert open_store(f"file://{root}?capacity_bytes=1M", capacity_bytes=5000).capacity_bytes == 5000  # the flag
    assert open_store(redis_url_placeholder := "redis://127.0.0.1:1").capacity_bytes == 0  # redis: server's maxmemory
    del redis_url_placeholder


def test_default_file_store_evicts_lru_and_publishes(tmp_path, monkeypatch):
    """The default path (no capacity given) with the sizing shrunk to three chunks: the store
    evicts least-recently-used chunks and names each evicted chunk in one BlockRemoved."""
    from cpd.store import capacity
    blocks = rand_blocks(2)
    probe = open_store(f"file://{tmp_path / 'probe'}", chunk_blocks=2, capacity_bytes=0)
    probe.put_blocks([1, 2], blocks)
    one = probe.stats().bytes
    probe.close()
    monkeypatch.setattr(capacity, "FLOOR_BYTES", 0)
    monkeypatch.setattr(capacity, "CAP_BYTES", 3 * one)
    ev = []
    s = open_store(f"file://{tmp_path / 'kv'}", chunk_blocks=2, event_sink=ev.append)
    assert s.capacity_bytes == 3 * one
    for i in range(5):
        s.put_blocks([10 * i + 1, 10 * i + 2], blocks)
        time.sleep(0.02)  # distinct mtimes (the kernel's file timestamps are clock-tick coarse)
        if i == 2:
            assert s.get_blocks([1, 2]) is not None  # chunk 0 used: most recent
            time.sleep(0.02)
    assert s.stats().bytes <= 3 * one
    rm = removed(ev)
    assert [e.block_hashes for e in rm] == [[11, 12], [21, 22]] and all(e.medium == "L3" for e in rm)
    assert s.lookup_prefix([1, 2]) == 2 and s.lookup_prefix([41, 42]) == 2
    s.close()
