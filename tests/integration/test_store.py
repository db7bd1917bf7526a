"""L3 store: round trips, visibility protocol, crashes, corruption, outages, races (both backends)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cpd.deploy import free_port
from cpd.kv.events import BlockRemoved, BlockStored
from cpd.store import StoreUnavailable, open_store
from cpd.store.chunk_format import decode_value, encode_value
from cpd.store.errors import CorruptValue
from cpd.store.connector import L3Connector

ROOT = Path(__file__).resolve().parents[2]
SHAPE = (2, 2, 16, 2, 8)  # [layers, K/V, block_size, kv_heads, head_dim]


def rand_blocks(n, seed=0, shape=SHAPE, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]


def hashes(n, base=1000):
    return [base + i for i in range(n)]


@pytest.fixture(params=["file", "redis", "mem"])
def make_store(request, tmp_path):
    """Factory: make_store(chunk_blocks=1, **kw) -> (store, events list)."""
    made = []
    if request.param == "redis":
        srv = request.getfixturevalue("redis_server")
        base = srv.url
    elif request.param == "mem":
        srv = None
        base = f"mem://{tmp_path.name}"
    else:
        srv = None
        base = f"file://{tmp_path / 'kv'}"

    def make(chunk_blocks=1, **kw):
        ev = []
        s = open_store(base, chunk_blocks=chunk_blocks, event_sink=ev.append, **kw)
        s.backend = request.param
        s.server = srv
        made.append(s)
        return s, ev

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("chunk_blocks", [1, 3])
def test_round_trip_bit_exact(make_store, chunk_blocks):
    s, ev = make_store(chunk_blocks)
    hs, blocks = hashes(7), rand_blocks(7)
    assert s.lookup_prefix(hs) == 0 and s.get_blocks(hs) is None
    assert s.put_blocks(hs, blocks, parent_block_hash=5, token_ids=list(range(7 * 16))) == 7
    assert s.lookup_prefix(hs) == 7
    assert s.lookup_prefix(hs + [1, 2]) == 7
    assert s.lookup_prefix([1] + hs) == 0
    got = s.get_blocks(hs)
    assert len(got) == 7
    for a, b in zip(got, blocks):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    # a sub-range starting mid-chunk is served from the covering chunks
    assert [a.tobytes() for a in s.get_blocks(hs[2:6])] == [b.tobytes() for b in blocks[2:6]]
    # hits are at chunk granularity: a prefix ending inside a chunk is found up to the
    # last chunk boundary it contains
    assert s.lookup_prefix(hs[:5] + [1]) == (5 if chunk_blocks == 1 else 3)
    stored = [e for e in ev if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == hs
    assert all(e.medium == "L3" and e.block_size == 16 for e in stored)
    assert stored[0].parent_block_hash == 5 and stored[0].token_ids == list(range(16 * len(stored[0].block_hashes)))
    # rewriting is a no-op (already visible)
    assert s.put_blocks(hs, blocks) == 0
    st = s.stats()
    assert st.num_blocks == 7 and st.bytes > 7 * blocks[0].nbytes
    assert s.delete(hs[-1:]) == 1 and s.lookup_prefix(hs) == (6 if chunk_blocks == 1 else 6)
    assert any(isinstance(e, BlockRemoved) and hs[-1] in e.block_hashes for e in ev)
    assert s.clear() >= 1 and s.lookup_prefix(hs) == 0 and s.stats().num_chunks == 0


def test_incremental_saves_and_dtypes(make_store):
    s, _ = make_store(4)
    hs = hashes(10)
    b16 = rand_blocks(10, seed=3, shape=(1, 2, 8, 1, 4), dtype=np.float16)
    assert s.put_blocks(hs[:3], b16[:3]) == 3
    assert s.lookup_prefix(hs) == 3
    assert s.put_blocks(hs[3:], b16[3:], parent_block_hash=hs[2]) == 7
    assert s.lookup_prefix(hs) == 10
    assert [a.tobytes() for a in s.get_blocks(hs)] == [b.tobytes() for b in b16]


def test_wire_format_rejects_tampering():
    hs, blocks = hashes(2), rand_blocks(2)
    v = encode_value(hs, blocks, 16)
    ch = decode_value(bytes(v), expect_last=hs[-1], expect_n=2)
    assert ch.block_hashes == hs and ch.block_size == 16
    for pos in (0, 10, 30, len(v) // 2, len(v) - 1):
        bad = bytearray(v)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptValue):
            decode_value(bytes(bad))
    with pytest.raises(CorruptValue):
        decode_value(bytes(v[:-1]))
    with pytest.raises(CorruptValue):
        decode_value(bytes(v), expect_last=hs[0])


def test_unsealed_write_is_invisible(make_store):
    s, ev = make_store(2)
    hs, blocks = hashes(2), rand_blocks(2)
    w = s.begin_write(hs, blocks)
    assert s.lookup_prefix(hs) == 0
    w.write(0.5)
    assert s.lookup_prefix(hs) == 0 and s.get_blocks(hs) is None
    w.write(1.0)
    assert s.lookup_prefix(hs) == 0 and s.get_blocks(hs) is None  # WRITING, not yet sealed
    assert w.seal() is True
    assert s.lookup_prefix(hs) == 2
    assert [a.tobytes() for a in s.get_blocks(hs)] == [b.tobytes() for b in blocks]
    # a partially written value is never sealed
    w2 = s.begin_write(hashes(1, 50), rand_blocks(1))
    w2.write(0.3)
    assert w2.seal() is False and s.lookup_prefix([50]) == 0


_WRITER = r"""
import os, sys, time, numpy as np
from cpd.store import open_store
s = open_store(sys.argv[1], chunk_blocks=1, stale_timeout_s=float(sys.argv[2]))
blk = np.random.default_rng(1).standard_normal((64, 1024)).astype(np.float32)
w = s.begin_write([7], [blk])
w.write(0.5)
print("staged", flush=True)
time.sleep(60)
"""


def _run_and_kill(code, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, env=env)
    try:
        line = p.stdout.readline()
        assert line.strip() == b"staged", line
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL


def test_writer_killed_mid_write_never_visible_and_reclaimed(make_store):
    s, _ = make_store(1, stale_timeout_s=0.3)
    if s.backend == "mem":
        pytest.skip("mem:// is process-local: no other process writes to it")
    url = s.url if s.backend == "file" else s.server.url
    _run_and_kill(_WRITER, url, "0.3")
    assert s.lookup_prefix([7]) == 0 and s.get_blocks([7]) is None
    if s.backend == "file":
        leftovers = [n for n in os.listdir(s.root) if n.startswith(".tmp.")]
        assert len(leftovers) == 1
        time.sleep(0.35)
        s.reclaim_stale()
        assert not [n for n in os.listdir(s.root) if n.startswith(".tmp.")]
    else:
        assert list(s.r.scan_iter(match="cpd:kv:stage:*"))  # staging key with a TTL
        time.sleep(0.4)
        assert not list(s.r.scan_iter(match="cpd:kv:*"))  # expired: reclaimed by Redis
    assert s.lookup_prefix([7]) == 0


def test_redis_client_killed_mid_set_never_visible(redis_server):
    """A raw client that sends half of a large SET and is SIGKILLed leaves nothing behind."""
    code = r"""
import socket, sys
k = b"cpd:kv:0000000000000007:1"
val_len = 4 << 20
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, val_len) + b"x" * (val_len // 2))
print("staged", flush=True)
import time; time.sleep(60)
"""
    _run_and_kill(code, str(redis_server.port))
    s = open_store(redis_server.url)
    time.sleep(0.1)
    assert s.lookup_prefix([7]) == 0 and s.get_blocks([7]) is None
    assert s.r.dbsize() == 0
    s.close()


def _flip_mem(s, key, pos_frac=0.5):
    raw, hs = s._sp.chunks[key]
    pos = int(len(raw) * pos_frac)
    s._sp.chunks[key] = (raw[:pos] + bytes([raw[pos] ^ 0xFF]) + raw[pos + 1:], hs)


def _corrupt(s, key_hash, n, pos_frac=0.5):
    if s.backend == "mem":
        _flip_mem(s, (key_hash, n), pos_frac)
    elif s.backend == "file":
        p = os.path.join(s.root, f"{key_hash:016x}.{n}.kv")
        size = os.path.getsize(p)
        with open(p, "r+b") as f:
            f.seek(int(size * pos_frac))
            b = f.read(1)
            f.seek(int(size * pos_frac))
            f.write(bytes([b[0] ^ 0xFF]))
    else:
        k = f"cpd:kv:{key_hash:016x}:{n}"
        size = s.r.strlen(k)
        pos = int(size * pos_frac)
        b = s.r.getrange(k, pos, pos)
        s.r.setrange(k, pos, bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("pos_frac", [0.01, 0.5, 0.999])
def test_corruption_is_miss_and_invalidated(make_store, pos_frac):
    s, ev = make_store(2)
    hs, blocks = hashes(4), rand_blocks(4)
    s.put_blocks(hs, blocks)
    _corrupt(s, hs[3], 2, pos_frac)
    ev.clear()
    assert s.lookup_prefix(hs) == 4  # not yet read: still visible
    got, reason = s.read_blocks(hs)
    assert got is None and reason == "corrupt"
    assert s.lookup_prefix(hs) == 2  # corrupt chunk invalidated, good chunk kept
    assert [a.tobytes() for a in s.get_blocks(hs[:2])] == [b.tobytes() for b in blocks[:2]]
    rm = [e for e in ev if isinstance(e, BlockRemoved)]
    assert rm and rm[0].medium == "L3" and hs[3] in rm[0].block_hashes
    assert s.stats().corrupt == 1
    # the connector reports it as a corrupt fallback and recovers after a rewrite
    c = L3Connector(s, write_async=False)
    s.put_blocks(hs, blocks)
    _corrupt(s, hs[1], 2, pos_frac)
    assert c.load(hs) is None and c.fallback_counts["corrupt"] == 1
    c.save(hs, None, [], blocks)
    assert [a.tobytes() for a in c.load(hs)] == [b.tobytes() for b in blocks]


def test_redis_unreachable_raises_and_connector_misses_fast(redis_server):
    s = open_store(redis_server.url)
    hs, blocks = hashes(3), rand_blocks(3)
    s.put_blocks(hs, blocks)
    c = L3Connector(s, write_async=True)
    assert c.lookup(hs) == 3
    redis_server.stop()
    for op in (lambda: s.lookup_prefix(hs), lambda: s.get_blocks(hs), lambda: s.put_blocks(hs, blocks),
               lambda: s.stats(), lambda: s.delete(hs), lambda: s.clear()):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            op()
        assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert c.lookup(hs) == 0
    assert c.load(hs) is None
    c.save(hs, None, [], blocks)
    assert c.flush(5.0)
    assert time.monotonic() - t0 < 2.0
    assert c.fallback_counts["unavailable"] == 3
    c.close()


def test_unresolvable_redis_host_is_unavailable():
    p = free_port()  # nothing listens there
    s = open_store(f"redis://127.0.0.1:{p}")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        s.lookup_prefix([1])
    assert time.monotonic() - t0 < 2.0
    assert L3Connector(s, write_async=False).lookup([1]) == 0


def test_file_store_directory_gone(tmp_path):
    import shutil
    s = open_store(f"file://{tmp_path / 'kv'}")
    s.put_blocks([1], rand_blocks(1))
    shutil.rmtree(tmp_path / "kv")
    for op in (lambda: s.lookup_prefix([1]), lambda: s.get_blocks([1]), lambda: s.put_blocks([1], rand_blocks(1))):
        with pytest.raises(StoreUnavailable):
            op()
    c = L3Connector(s, write_async=False)
    assert c.lookup([1]) == 0 and c.load([1]) is None and c.fallback_counts["unavailable"] == 2


def test_two_writers_first_seal_wins(make_store):
    s, ev = make_store(1)
    a, b = rand_blocks(1, seed=1), rand_blocks(1, seed=2)
    wa, wb = s.begin_write([9], a), s.begin_write([9], b)
    wa.write()
    wb.write()
    assert wb.seal() is True
    assert wa.seal() is False
    assert s.get_blocks([9])[0].tobytes() == b[0].tobytes()
    assert s.put_blocks([9], a) == 0  # dropped: already visible
    assert s.get_blocks([9])[0].tobytes() == b[0].tobytes()
    assert s.stats().num_chunks == 1


def test_concurrent_writers_one_intact_value(make_store):
    s, _ = make_store(1)
    vals = [rand_blocks(1, seed=i, shape=(256, 256)) for i in range(6)]
    won = []
    s2, _ = make_store(1)
    barrier = threading.Barrier(len(vals))

    def go(i):
        st = s if i % 2 else s2
        barrier.wait()
        won.append(st.put_blocks([11], vals[i], skip_existing=False))

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(vals))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sum(won) == 1
    got = s.get_blocks([11])[0].tobytes()
    assert got in [v[0].tobytes() for v in vals]


def test_connector_on_written_runs_after_each_write_with_its_events_emitted(make_store):
    """The worker flushes its KV events from this hook: a write's BlockStored(L3) is emitted before
    the hook runs, and a hook that raises never stops the writer."""
    s, _ = make_store(1)
    events: list = []
    seen: list[int] = []

    def hook() -> None:
        seen.append(len([e for e in events if isinstance(e, BlockStored)]))
        if len(seen) == 1:
            raise RuntimeError("hook failed")

    c = L3Connector(s, event_sink=events.append, write_async=True, on_written=hook)
    hs, blocks = hashes(4), rand_blocks(4)
    c.save(hs[:2], None, list(range(32)), blocks[:2])
    c.save(hs[2:], hs[1], list(range(32, 64)), blocks[2:])
    assert c.flush(5.0)
    assert len(seen) == 2 and seen[0] >= 1 and seen[1] > seen[0], seen
    assert c.lookup(hs) == 4 and isinstance(c.last_error, RuntimeError)
    c.close()


def test_connector_async_save_queue_and_events(make_store):
    s, _ = make_store(1)
    events = []
    c = L3Connector(s, event_sink=events.append, write_async=True, max_queue=2, max_pending_bytes=1 << 30)
    hs, blocks = hashes(4), rand_blocks(4)
    c.save(hs, None, list(range(64)), blocks)
    for b in blocks:
        b[...] = 0  # engine reuses its buffers: the connector copied them
    assert c.flush(5.0)
    assert c.lookup(hs) == 4 and c.blocks_saved == 4
    assert all(a.any() for a in c.load(hs))
    assert [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes] == hs
    # byte budget exhausted -> dropped and counted, never blocks
    c.max_pending_bytes = 1
    c.save(hashes(1, 77), None, [], rand_blocks(1))
    assert c.fallback_counts["queue_full"] == 1
    c.close()
    c.close()  # idempotent
    c.save(hs, None, [], blocks)  # after close: dropped, counted, no error
    assert c.fallback_counts["queue_full"] == 2


def test_open_store_urls(tmp_path, redis_server):
    s = open_store(f"file://{tmp_path}/a?chunk_blocks=4&stale_timeout_s=5")
    assert s.chunk_blocks == 4 and s.stale_timeout_s == 5.0
    r = open_store(f"{redis_server.url}/2?chunk_blocks=2&prefix=x:")
    assert r.chunk_blocks == 2 and r.prefix == "x:" and r.ping()
    with pytest.raises(ValueError):
        open_store("s3://bucket")


# --- what the router's L3 view is rebuilt and corrected from (issue 7 §6) -------------------

def _stored_chunks(ev):
    return [list(e.block_hashes) for e in ev if isinstance(e, BlockStored)]


def test_listing_reannounce_and_per_chunk_events(make_store):
    s, ev = make_store(4)
    hs, blocks = hashes(10), rand_blocks(10)
    assert s.put_blocks(hs, blocks) == 10
    chunks = [hs[0:4], hs[4:8], hs[8:10]]
    assert _stored_chunks(ev) == chunks  # one event per chunk, chain order
    assert sorted(s.list_visible()) == sorted([(hs[3], 4), (hs[7], 4), (hs[9], 2)])
    # writing what exists writes nothing but re-announces every existing chunk
    ev.clear()
    assert s.put_blocks(hs, blocks) == 0
    assert _stored_chunks(ev) == chunks
    # a writer's probe re-announces the chunks covering the leading blocks it found
    ev.clear()
    assert s.lookup_prefix(hs + [7, 8], announce=True, block_size=16) == 10
    assert _stored_chunks(ev) == chunks
    # a delete names each removed chunk with its blocks
    ev.clear()
    assert s.delete([hs[7]]) == 1
    assert [e.block_hashes for e in ev if isinstance(e, BlockRemoved)] == [[hs[7]]]
    ev.clear()
    assert s.delete(hs) == 2
    assert sorted(e.block_hashes for e in ev if isinstance(e, BlockRemoved)) == [hs[0:4], hs[8:10]]
    assert s.list_visible() == []


def test_reads_report_exactly_what_is_present_and_gone(make_store):
    """A corrupt chunk in the middle: the observation names it gone and the others present."""
    s, ev = make_store(4)
    seen = []
    s.observation_sink = seen.append
    hs, blocks = hashes(12), rand_blocks(12)
    s.put_blocks(hs, blocks)
    key = (hs[7], 4)
    if s.backend == "mem":
        _flip_mem(s, key)
    elif s.backend == "file":
        p = s._path(key)
        raw = bytearray(open(p, "rb").read())
        raw[len(raw) // 2] ^= 0xFF
        open(p, "wb").write(bytes(raw))
    else:
        raw = bytearray(s.r.get(s._key(key)))
        raw[len(raw) // 2] ^= 0xFF
        s.r.set(s._key(key), bytes(raw))
    assert s.lookup_prefix(hs) == 12
    assert seen[-1].block_hashes == hs and sorted(seen[-1].present) == [(hs[3], 4), key, (hs[11], 4)]
    blocks_read, reason = s.read_blocks(hs)
    assert blocks_read is None and reason == "corrupt"
    obs = seen[-1]
    assert obs.gone == [key] and sorted(obs.present) == [(hs[3], 4), (hs[11], 4)]
    assert [e.block_hashes for e in ev if isinstance(e, BlockRemoved)] == [hs[4:8]]
    assert s.lookup_prefix(hs) == 4  # the valid leading chunk is still served


def test_connector_observations_bounded_and_drained(make_store):
    s, _ = make_store(2)
    c = L3Connector(s, write_async=False, max_observations=3)
    hs = hashes(4)
    c.save(hs, None, [], rand_blocks(4))
    for i in range(5):
        assert c.lookup(hs[:i % 4 + 1]) in (0, 2, 4)
    got = c.drain_observations()
    assert len(got) == 3 and got[-1]["block_hashes"] == hs[:1]  # the latest three, oldest first
    assert c.drain_observations() == []
    # a writer's probe re-announces what exists and tells how much needs no write
    assert c.lookup_and_announce(hs, None, [], 16) == 4
    c.close()
