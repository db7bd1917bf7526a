"""Property test of the visibility protocol over random interleavings (both backends).

Ops on a small key space: begin a write, write part/all of it, seal, crash (abandon the
writer), read, evict, reclaim. Invariants: a read returns None or exactly the bytes of the
write that sealed first; lookup counts only sealed (VISIBLE) blocks; a seal succeeds iff the
value was fully written and no other write of that block is visible.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpd.store import open_store

KEYS = [101, 102, 103]
SHAPE = (4, 8)

op = st.one_of(
    st.tuples(st.just("begin"), st.sampled_from(KEYS), st.integers(0, 2**16)),
    st.tuples(st.just("write"), st.integers(0, 7), st.sampled_from([0.25, 0.5, 1.0])),
    st.tuples(st.just("seal"), st.integers(0, 7)),
    st.tuples(st.just("crash"), st.integers(0, 7)),
    st.tuples(st.just("read"), st.sampled_from(KEYS)),
    st.tuples(st.just("evict"), st.sampled_from(KEYS)),
    st.tuples(st.just("reclaim")),
)


def _block(seed):
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def run_ops(store, ops):
    store.clear()
    visible: dict[int, bytes] = {}
    writers: list[list] = []  # [pending, key, bytes, fraction_written, alive, lost]
    for o in ops:
        kind = o[0]
        if kind == "begin":
            blk = _block(o[2])
            writers.append([store.begin_write([o[1]], [blk]), o[1], blk.tobytes(), 0.0, True, False])
        elif kind in ("write", "seal", "crash"):
            if not writers:
                continue
            w = writers[o[1] % len(writers)]
            if not w[4]:
                continue
            if kind == "write":
                w[0].write(o[2])
                w[3] = max(w[3], o[2])
            elif kind == "seal":
                ok = w[0].seal()
                w[4] = False
                expect = w[3] >= 1.0 and w[1] not in visible and not w[5]
                assert ok == expect
                if ok:
                    visible[w[1]] = w[2]
            else:  # writer dies: its staging data is simply abandoned
                w[4] = False
        elif kind == "read":
            got = store.get_blocks([o[1]])
            if o[1] in visible:
                assert got is not None and got[0].tobytes() == visible[o[1]]
            else:
                assert got is None
        elif kind == "evict":
            store.delete([o[1]])
            visible.pop(o[1], None)
        elif kind == "reclaim":
            store.reclaim_stale(0.0)
            for w in writers:  # staged data of in-flight writers is gone: they can never seal
                if w[4] and w[3] > 0:
                    w[5] = True
        for k in KEYS:
            assert store.lookup_prefix([k]) == (1 if k in visible else 0)
    assert store.stats().num_chunks == len(visible)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(op, max_size=25))
def test_visibility_file(tmp_path, ops):
    s = open_store(f"file://{tmp_path}/kv")
    run_ops(s, ops)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(op, max_size=25))
def test_visibility_redis(redis_server, ops):
    s = open_store(redis_server.url)
    try:
        run_ops(s, ops)
    finally:
        s.close()
