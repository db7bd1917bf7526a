"""KV handoff: shm and TCP paths across real processes, release/reclaim, arena-full fallback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from msgspec.structs import replace

from cpd.worker.handoff import HandoffError, HandoffReceiver, HandoffSender, host_identity

ROOT = Path(__file__).resolve().parents[2]

_RECEIVER = r"""
import json, sys, numpy as np
from cpd.worker.handoff import HandoffReceiver
r = HandoffReceiver(force_tcp=sys.argv[1] == "tcp")
for line in sys.stdin:
    h = json.loads(line)
    path = r.path_for(h)
    a = r.fetch(h)
    np.save(h["meta"]["out"], a)
    print(json.dumps({"path": path, "rid": h["request_id"]}), flush=True)
r.close()
"""

_SENDER = r"""
import json, sys, msgspec, numpy as np
from cpd.worker.handoff import HandoffSender
s = HandoffSender(arena_bytes=int(sys.argv[1]))
a = np.random.default_rng(int(sys.argv[2])).standard_normal((4, 2, 300, 4, 16)).astype(np.float32)
print(msgspec.json.encode(s.stage("req-x", a, meta={"first_token": 42})).decode(), flush=True)
sys.stdin.readline()  # wait until the receiver is done
print(json.dumps(s.stats()), flush=True)
s.close()
"""


def _spawn(code, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True)


def kv(seed, tokens=300):
    return np.random.default_rng(seed).standard_normal((4, 2, tokens, 4, 16)).astype(np.float32)


@pytest.mark.parametrize("mode", ["shm", "tcp"])
def test_round_trip_to_another_process(tmp_path, mode):
    arrays = {f"r{i}": kv(i, tokens=100 + 50 * i) for i in range(3)}
    with HandoffSender(arena_bytes=16 << 20) as s:
        p = _spawn(_RECEIVER, mode)
        try:
            for rid, a in arrays.items():
                h = s.stage(rid, a, meta={"out": str(tmp_path / f"{rid}.npy")})
                assert h.kind == "shm"  # fits the arena; the receiver decides the path
                p.stdin.write(msgspec.json.encode(h).decode() + "\n")
                p.stdin.flush()
                rep = json.loads(p.stdout.readline())
                assert rep == {"path": mode, "rid": rid}
                got = np.load(tmp_path / f"{rid}.npy")
                assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes()
                assert s.release(rid)
            p.stdin.close()
            assert p.wait(20) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        st = s.stats()
        assert st["bytes_staged"] == 0 and st["arena_free_bytes"] == st["arena_bytes"]
        assert st["tcp_served"] == (3 if mode == "tcp" else 0)


def test_receive_from_sender_process_shm():
    p = _spawn(_SENDER, str(16 << 20), "7")
    try:
        h = json.loads(p.stdout.readline())
        assert h["kind"] == "shm" and h["host_id"] == host_identity() and h["meta"] == {"first_token": 42}
        with HandoffReceiver() as r, HandoffReceiver(force_tcp=True) as rt:
            want = np.random.default_rng(7).standard_normal((4, 2, 300, 4, 16)).astype(np.float32)
            assert r.fetch(h).tobytes() == want.tobytes()
            assert rt.fetch(h).tobytes() == want.tobytes()
            out = np.empty_like(want)
            assert r.fetch(h, out=out) is out and out.tobytes() == want.tobytes()
            assert r.stats()["fetched_shm"] == 2 and rt.stats()["fetched_tcp"] == 1
        p.stdin.write("done\n")
        p.stdin.flush()
        st = json.loads(p.stdout.readline())
        assert st["tcp_served"] == 1
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not os.path.exists(h["name"])  # arena unlinked on close


def test_arena_full_falls_back_to_tcp_and_release_frees(tmp_path):
    a, b, c = kv(1, 1024), kv(2, 1024), kv(3, 1024)  # 2 MiB each
    with HandoffSender(arena_bytes=3 << 20) as s, HandoffReceiver() as r:
        ha = s.stage("a", a)
        hb = s.stage("b", b)
        assert ha.kind == "shm" and hb.kind == "tcp"
        assert s.stats()["arena_full_fallbacks"] == 1
        assert r.path_for(hb) == "tcp"
        assert r.fetch(hb).tobytes() == b.tobytes()
        assert r.fetch(ha).tobytes() == a.tobytes()
        free_before = s.stats()["arena_free_bytes"]
        assert s.release("a") and not s.release("a")
        assert s.stats()["arena_free_bytes"] == free_before + a.nbytes + 4096  # payload + its header page
        hc = s.stage("c", c)
        assert hc.kind == "shm" and hc.offset == ha.offset  # the space is reused
        assert r.fetch(hc).tobytes() == c.tobytes()
        assert s.release("b") and s.release("c")
        with pytest.raises(HandoffError):
            HandoffReceiver(force_tcp=True).fetch(hb)  # released: the sender no longer holds it
        st = s.stats()
        assert st["bytes_staged"] == 0 and st["arena_free_bytes"] == st["arena_bytes"]


def test_full_arena_fallback_reaches_another_process(tmp_path):
    with HandoffSender(arena_bytes=1 << 20) as s:
        a = kv(5, 1024)
        h = s.stage("big", a, meta={"out": str(tmp_path / "big.npy")})
        assert h.kind == "tcp"
        p = _spawn(_RECEIVER, "auto")
        try:
            p.stdin.write(msgspec.json.encode(h).decode() + "\n")
            p.stdin.close()
            assert json.loads(p.stdout.readline())["path"] == "tcp"
            assert p.wait(20) == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert np.load(tmp_path / "big.npy").tobytes() == a.tobytes()


def test_reclaim_never_released():
    with HandoffSender(arena_bytes=4 << 20, reclaim_after_s=0.2) as s:
        s.stage("x", kv(1, 512))
        s.stage("y", kv(2, 512), force_tcp=True)
        assert s.stats()["num_staged"] == 2
        time.sleep(0.25)
        s.stage("z", kv(3, 16))  # staging reclaims expired entries first
        st = s.stats()
        assert st["reclaimed"] == 2 and st["num_staged"] == 1
        assert not s.release("x")


def test_other_host_uses_tcp_and_errors():
    with HandoffSender(arena_bytes=1 << 20) as s, HandoffReceiver() as r:
        a = kv(9, 8)
        h = s.stage("q", a)
        foreign = replace(h, host_id="elsewhere/boot")
        assert r.path_for(foreign) == "tcp"
        assert r.fetch(foreign).tobytes() == a.tobytes()
        with pytest.raises(ValueError):
            s.stage("q", a)
        with pytest.raises(HandoffError):
            r.fetch(replace(h, kind="tcp", request_id="nope"))
        with pytest.raises(HandoffError):
            r.fetch(replace(h, shape=(1,)))
        with pytest.raises(HandoffError):  # a JSON handle that is not one: refused, named
            r.fetch({"kind": "shm", "nbytes": "many"})
        # empty arrays and torch tensors
        e = s.stage("empty", np.zeros((0, 4), np.float32))
        assert r.fetch(e).shape == (0, 4)
        torch = pytest.importorskip("torch")
        t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        assert np.array_equal(r.fetch(s.stage("t", t)), t.numpy())
    with pytest.raises(HandoffError):
        HandoffReceiver(timeout_s=0.5).fetch(replace(h, kind="tcp"))  # sender closed


def test_killed_sender_leaves_no_shared_memory_behind():
    """The arena is an anonymous memfd: SIGKILL of the sender frees it (no /dev/shm leftovers)."""
    import signal
    code = ("import json, sys, msgspec, numpy as np\n"
            "from cpd.worker.handoff import HandoffSender\n"
            "s = HandoffSender(arena_bytes=8 << 20)\n"
            "print(msgspec.json.encode(s.stage('r', np.ones(1024, np.float32))).decode(), flush=True)\n"
            "sys.stdin.readline()\n")
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    h = json.loads(p.stdout.readline())
    r = HandoffReceiver()
    assert np.array_equal(r.view(h), np.ones(1024, np.float32))
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    r.close()
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not [f for f in after - before if f.startswith("cpd-handoff")]
    assert not os.path.exists(h["name"])


def test_handle_for_another_arena_is_refused():
    with HandoffSender(arena_bytes=4 << 20) as s:
        h = s.stage("r", np.arange(16, dtype=np.float32))
        bad = replace(h, arena_id="0" * 32)
        with pytest.raises(HandoffError):
            HandoffReceiver().view(bad)
        assert np.array_equal(HandoffReceiver().view(h), np.arange(16, dtype=np.float32))


def _sender_process(value: float):
    code = ("import json, sys, msgspec, numpy as np\n"
            "from cpd.worker.handoff import HandoffSender\n"
            "s = HandoffSender(arena_bytes=8 << 20)\n"
            f"print(msgspec.json.encode(s.stage('r', np.full(1024, {value}, np.float32))).decode(), flush=True)\n"
            "sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, json.loads(p.stdout.readline())


def test_receiver_drops_maps_of_restarted_senders():
    """A mapping keeps a dead sender's memfd alive: each restart of a prefill-side worker must not
    leave one more arena mapped in the decode worker (issue 7 §8)."""
    r = HandoffReceiver()
    try:
        for i in range(4):  # a sender "restarted" four times
            p, h = _sender_process(float(i))
            assert np.array_equal(r.fetch(h), np.full(1024, float(i), np.float32))
            assert r.stats()["arenas_mapped"] == 1
            p.kill()
            p.wait(10)
    finally:
        r.close()


def test_receiver_maps_at_most_max_arenas_of_live_senders():
    senders = [HandoffSender(arena_bytes=4 << 20) for _ in range(3)]
    r = HandoffReceiver(max_arenas=2)
    try:
        handles = [s.stage("r", np.full(64, float(i), np.float32)) for i, s in enumerate(senders)]
        for _ in range(2):
            for i, h in enumerate(handles):
                assert np.array_equal(r.fetch(h), np.full(64, float(i), np.float32))
                assert r.stats()["arenas_mapped"] <= 2
    finally:
        r.close()
        for s in senders:
            s.close()


def test_stage_into_fills_the_staging_area_directly_and_frees_it_when_fill_fails():
    with HandoffSender(arena_bytes=4 << 20) as s:
        free0 = s.stats()["arena_free_bytes"]
        src = np.arange(1000, dtype=np.int16).reshape(10, 100)
        for force_tcp in (False, True):
            h = s.stage_into(f"r{force_tcp}", src.shape, src.dtype, lambda out: np.copyto(out, src), force_tcp=force_tcp)
            assert (h.kind == "tcp") == force_tcp
            assert np.array_equal(HandoffReceiver().fetch(h), src)
            assert s.release(h.request_id, h.generation)

        def boom(out):
            out[:] = 7
            raise RuntimeError("export failed")
        with pytest.raises(RuntimeError):
            s.stage_into("bad", src.shape, src.dtype, boom)
        assert s.stats()["arena_free_bytes"] == free0 and s.stats()["num_staged"] == 0


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (``T`` in /proc)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for t in os.listdir(f"/proc/{pid}/task")]
        if all(st == "T" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_tcp_fetch_from_a_stopped_sender_ends_within_the_callers_bound():
    """A sender stopped (SIGSTOP: a hung or partitioned host) after staging: its kernel still
    accepts connections, so only timeouts end a fetch. With ``timeout_s`` the whole fetch (the
    stale cached connection, the fresh one, the challenge and the reads together) ends within it,
    not after two of the receiver's per-socket timeouts (the router's first-byte bound was shorter
    than those, so it blamed the healthy decode worker)."""
    import signal
    code = ("import sys, msgspec, numpy as np\n"
            "from cpd.worker.handoff import HandoffSender\n"
            "s = HandoffSender(arena_bytes=8 << 20, secret=b'k')\n"
            "for rid in ('a', 'b'):\n"
            "    print(msgspec.json.encode(s.stage(rid, np.full(4096, 3, np.float32))).decode(), flush=True)\n"
            "sys.stdin.readline()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        a, b = (json.loads(p.stdout.readline()) for _ in range(2))
        with HandoffReceiver(force_tcp=True, timeout_s=5.0, secret=b"k") as r:
            assert np.array_equal(r.fetch(a, timeout_s=5.0), np.full(4096, 3, np.float32))  # caches the connection
            p.send_signal(signal.SIGSTOP)
            _wait_stopped(p.pid)  # the signal takes effect when the process is next scheduled: on a
            # loaded machine its serving thread answered one more fetch first (CI: "DID NOT RAISE")
            for _ in range(2):  # the cached connection first, then fresh ones
                t0 = time.monotonic()
                with pytest.raises(HandoffError, match="TCP fetch"):
                    r.fetch(b, timeout_s=0.8)
                assert time.monotonic() - t0 < 3.0  # the bound (0.8 s), far below one per-socket timeout (5 s)
    finally:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait(10)
