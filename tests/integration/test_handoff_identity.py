"""Issue 7 §1: a handoff handle names exactly one staging. A handle whose region was reclaimed
and restaged (same offset), whose request id was reused, or whose region is rewritten while it
is read is refused every time — on the shared-memory path and on the TCP path."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from msgspec.structs import replace

from cpd.messages.handoff import HandoffHandle
from cpd.worker.handoff import HandoffReceiver, HandoffSender, HandoffStaleError


def kv(seed, tokens=256):
    return np.random.default_rng(seed).standard_normal((2, 2, tokens, 2, 16)).astype(np.float32)


@pytest.fixture
def pair():
    with HandoffSender(arena_bytes=4 << 20) as s, HandoffReceiver() as r, HandoffReceiver(force_tcp=True) as rt:
        yield s, r, rt


def _reclaim_and_restage(s: HandoffSender, rid_old: str, rid_new: str, arr: np.ndarray) -> HandoffHandle:
    assert s.reclaim(max_age_s=0.0) >= 1  # the old staging is reclaimed ...
    return s.stage(rid_new, arr)          # ... and its region handed to another request


@pytest.mark.parametrize("reader", ["fetch", "view", "tcp"])
def test_reclaimed_and_restaged_region_is_refused(pair, reader):
    s, r, rt = pair
    old = s.stage("req-a", kv(1))
    new = _reclaim_and_restage(s, "req-a", "req-b", kv(2))
    assert new.offset == old.offset  # same region: the old code read req-b's KV here
    with pytest.raises(HandoffStaleError):
        {"fetch": r.fetch, "view": r.view, "tcp": rt.fetch}[reader](old)
    assert r.fetch(new).tobytes() == kv(2).tobytes()  # the live staging still reads fine


def test_restaged_with_identical_bytes_is_still_refused(pair):
    s, r, rt = pair
    old = s.stage("req-a", kv(3))
    _reclaim_and_restage(s, "req-a", "req-b", kv(3))  # same payload, another staging
    for reader in (r.fetch, r.view, rt.fetch):
        with pytest.raises(HandoffStaleError):
            reader(old)


def test_released_region_is_refused(pair):
    s, r, rt = pair
    h = s.stage("req-a", kv(4))
    assert s.release("req-a", h.generation)
    for reader in (r.fetch, r.view, rt.fetch):
        with pytest.raises(HandoffStaleError):
            reader(h)


def test_payload_not_matching_checksum_is_refused(pair):
    """The checksum layer on its own: a handle whose generation matches but whose bytes differ."""
    s, r, rt = pair
    a = s.stage("req-a", kv(5))
    b = s.stage("req-b", kv(6))
    for reader in (r.fetch, rt.fetch):
        with pytest.raises(HandoffStaleError):
            reader(replace(b, checksum=a.checksum))


def test_reused_request_id_over_tcp(pair):
    """The TCP server looks entries up by request id: a reused id must not serve the new data."""
    s, r, rt = pair
    old = s.stage("req-a", kv(7), force_tcp=True)
    assert s.release("req-a")
    new = s.stage("req-a", kv(8), force_tcp=True)  # same id, another staging
    with pytest.raises(HandoffStaleError):
        rt.fetch(old)
    with pytest.raises(HandoffStaleError):
        r.fetch(old)  # a "tcp" handle goes over TCP whatever the receiver
    assert rt.fetch(new).tobytes() == kv(8).tobytes()


def test_late_release_never_frees_a_newer_staging(pair):
    s, r, _ = pair
    old = s.stage("req-a", kv(9))
    assert s.release("req-a", old.generation)
    new = s.stage("req-a", kv(10))
    assert not s.release("req-a", old.generation)  # the late release of the first staging
    assert s.stats()["num_staged"] == 1
    assert r.fetch(new).tobytes() == kv(10).tobytes()
    assert s.release("req-a", new.generation)


def test_concurrent_restaging_never_returns_foreign_bytes():
    """Readers race a sender that reclaims and restages the same region with other payloads:
    every read either returns exactly its own staging's bytes or raises HandoffStaleError."""
    payloads = [kv(100 + i, tokens=2048) for i in range(4)]  # 1 MiB each: copies take a while
    stop = threading.Event()
    handles: list[tuple[dict, int]] = []
    lock = threading.Lock()
    with HandoffSender(arena_bytes=2 << 20) as s, HandoffReceiver() as r, HandoffReceiver(force_tcp=True) as rt:
        def restage():
            i = 0
            while not stop.is_set():
                s.reclaim(max_age_s=0.0)
                h = s.stage(f"r{i}", payloads[i % 4])
                with lock:
                    handles.append((h, i % 4))
                i += 1
        t = threading.Thread(target=restage, daemon=True)
        t.start()
        ok = stale = 0
        deadline = time.monotonic() + 3.0
        try:
            while time.monotonic() < deadline:
                with lock:
                    if not handles:
                        continue
                    h, k = handles[-1]
                for reader in (r.fetch, rt.fetch):
                    try:
                        got = reader(h)
                    except HandoffStaleError:
                        stale += 1
                        continue
                    assert got.tobytes() == payloads[k].tobytes(), "read another staging's bytes"
                    ok += 1
        finally:
            stop.set()
            t.join(5)
    assert stale > 0 and ok + stale > 20, (ok, stale)
