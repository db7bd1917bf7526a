"""L3 store on a real local 3-node Redis Cluster (Debian's redis-server + redis-cli --cluster create)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from cpd.kv.events import BlockRemoved, BlockStored
from cpd.store import StoreUnavailable, open_store
from cpd.store.connector import L3Connector
from cpd.store.redis_cluster_store import RedisClusterStore

SHAPE = (2, 2, 16, 2, 8)


def rand_blocks(n, seed=0, shape=SHAPE):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def _port_free(p):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", p))
            return True
        except OSError:
            return False


def _free_ports(n):
    """Ports P with P and its cluster-bus port P+10000 both free."""
    import random
    out = []
    while len(out) < n:
        p = random.randrange(10000, 22000)  # P and P+10000 below the ephemeral range
        if p not in out and _port_free(p) and _port_free(p + 10000):
            out.append(p)
    return out


def _cli(port, *args, timeout=10):
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=timeout).stdout


class RedisCluster3:
    """Three cluster-enabled redis-server processes joined with ``redis-cli --cluster create``
    (no replicas). ``stop()``/``start()`` restart them on the same ports and node configs."""

    def __init__(self, tmp: Path, extra_args: tuple[str, ...] = ()):
        self.ports = _free_ports(3)
        self.tmp = tmp
        self.extra_args = extra_args
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _spawn(self, p: int) -> subprocess.Popen:
        exe = shutil.which("redis-server")
        if exe is None or shutil.which("redis-cli") is None:
            pytest.fail("redis-server/redis-cli not installed")
        d = self.tmp / str(p)
        d.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            [exe, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(d), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", "1000", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self, create: bool = False) -> None:
        for p in self.ports:
            self.procs.append(self._spawn(p))
        for p in self.ports:
            self._wait_port(p)
        if create:
            out = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                                  "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
        self.wait_ok()

    @staticmethod
    def _wait_port(p):
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", p), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {p} did not start")

    def wait_ok(self, timeout=20.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if all("cluster_state:ok" in _cli(p, "cluster", "info") for p in self.ports):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for pr in self.procs:
            pr.terminate()
        for pr in self.procs:
            pr.wait(10)
        self.procs = []

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i`` (its slots' data is lost: no persistence, no replica)."""
        self.procs[i].kill()
        self.procs[i].wait(10)

    def restart_node(self, i: int) -> None:
        """Start node ``i`` again on its port with its nodes.conf (it rejoins empty)."""
        self.procs[i] = self._spawn(self.ports[i])
        self._wait_port(self.ports[i])
        self.wait_ok()

    def flush(self) -> None:
        for p in self.ports:
            _cli(p, "flushall")

    def config_set(self, *args) -> None:
        for p in self.ports:
            _cli(p, "config", "set", *args)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisCluster3(tmp_path_factory.mktemp("cluster"))
    c.start(create=True)
    yield c
    c.stop()


@pytest.fixture
def cstore(cluster):
    made = []

    def make(chunk_blocks=1, **kw):
        ev = []
        s = open_store(cluster.url, chunk_blocks=chunk_blocks, event_sink=ev.append, **kw)
        made.append(s)
        return s, ev

    cluster.flush()
    yield make
    for s in made:
        s.close()


def test_cluster_url_forms(cluster):
    host_port = cluster.url.split("//")[1].split(",")[0]
    for url in (cluster.url, f"redis://{host_port}?cluster=1&chunk_blocks=2"):
        s = open_store(url)
        assert isinstance(s, RedisClusterStore) and s.ping()
        s.close()
    # keys of a chunk and its staging keys share a hash slot (the hash tag)
    s = open_store(cluster.url)
    k = (0xabc, 2)
    assert s.r.keyslot(s._key(k)) == s.r.keyslot(s._stage_key(k))
    assert len({s.r.keyslot(m) for m in s.lru.keys}) == 1
    s.close()


@pytest.mark.parametrize("chunk_blocks", [1, 3])
def test_cluster_round_trip_and_lookup(cstore, chunk_blocks):
    s, ev = cstore(chunk_blocks)
    hs, blocks = list(range(1000, 1012)), rand_blocks(12)
    assert s.lookup_prefix(hs) == 0 and s.get_blocks(hs) is None
    assert s.put_blocks(hs, blocks, parent_block_hash=5, token_ids=list(range(12 * 16))) == 12
    # the chunks really are spread over the nodes
    nodes = {s.r.get_node_from_key(s._key(k)).name for k, _ in s._scan()}
    assert len(nodes) >= 2
    assert s.lookup_prefix(hs) == 12 and s.lookup_prefix(hs + [1]) == 12 and s.lookup_prefix([1] + hs) == 0
    assert [a.tobytes() for a in s.get_blocks(hs)] == [b.tobytes() for b in blocks]
    assert [a.tobytes() for a in s.get_blocks(hs[3:9])] == [b.tobytes() for b in blocks[3:9]]
    assert [h for e in ev if isinstance(e, BlockStored) for h in e.block_hashes] == hs
    assert s.put_blocks(hs, blocks) == 0
    st = s.stats()
    assert st.num_blocks == 12
    # a second client sees the same data
    s2, _ = cstore(chunk_blocks)
    assert s2.lookup_prefix(hs) == 12
    assert s.delete(hs[-1:]) == 1 and s.lookup_prefix(hs) == 12 - chunk_blocks
    assert s.clear() >= 1 and s.lookup_prefix(hs) == 0 and s.stats().num_chunks == 0


def test_cluster_first_writer_wins(cstore):
    s, _ = cstore(2)
    a, b = rand_blocks(2, seed=1), rand_blocks(2, seed=2)
    wa, wb = s.begin_write([8, 9], a), s.begin_write([8, 9], b)
    wa.write(0.5)
    assert s.lookup_prefix([8, 9]) == 0
    wa.write()
    wb.write()
    assert s.lookup_prefix([8, 9]) == 0  # written, not sealed
    assert wb.seal() is True and wa.seal() is False
    assert [x.tobytes() for x in s.get_blocks([8, 9])] == [x.tobytes() for x in b]
    assert s.put_blocks([8, 9], a) == 0
    # concurrent put_blocks from two clients: exactly one wins
    s2, _ = cstore(1)
    s1, _ = cstore(1)
    vals = [rand_blocks(1, seed=10 + i, shape=(128, 256)) for i in range(4)]
    won, bar = [], threading.Barrier(4)

    def go(i):
        bar.wait()
        won.append((s1 if i % 2 else s2).put_blocks([77], vals[i], skip_existing=False))

    ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sum(won) == 1
    assert s1.get_blocks([77])[0].tobytes() in [v[0].tobytes() for v in vals]


def test_cluster_corruption_invalidates(cstore):
    s, ev = cstore(2)
    hs, blocks = [1, 2, 3, 4], rand_blocks(4)
    s.put_blocks(hs, blocks)
    k = s._key((4, 2))
    pos = s.r.strlen(k) // 2
    s.r.setrange(k, pos, bytes([s.r.getrange(k, pos, pos)[0] ^ 0xFF]))
    ev.clear()
    got, reason = s.read_blocks(hs)
    assert got is None and reason == "corrupt"
    assert s.lookup_prefix(hs) == 2
    rm = [e for e in ev if isinstance(e, BlockRemoved)]
    assert rm and rm[0].medium == "L3" and set(rm[0].block_hashes) == {3, 4}
    c = L3Connector(s, write_async=False)
    assert c.load(hs) is None and c.fallback_counts["miss"] == 1
    c.save(hs, None, [], blocks)
    assert [a.tobytes() for a in c.load(hs)] == [b.tobytes() for b in blocks]


def test_cluster_capacity_lru(cstore):
    blocks = rand_blocks(2)
    s, ev = cstore(2)
    one = s.put_blocks([1, 2], blocks) and s.stats().bytes
    s.clear()
    s, ev = cstore(2, capacity_bytes=3 * one)
    s_other, _ = cstore(2, capacity_bytes=3 * one)  # another "process"
    for i in range(3):
        s.put_blocks([10 * i + 1, 10 * i + 2], blocks)
    assert s.used_bytes() == 3 * one
    assert s_other.get_blocks([1, 2]) is not None  # touch chunk 0 from the other client
    s.put_blocks([31, 32], blocks)  # over capacity: evicts the LRU chunk, i.e. chunk 1
    assert s.lookup_prefix([1, 2]) == 2 and s.lookup_prefix([11, 12]) == 0
    assert s.lookup_prefix([21, 22]) == 2 and s.lookup_prefix([31, 32]) == 2
    rm = [e for e in ev if isinstance(e, BlockRemoved)]
    assert len(rm) == 1 and set(rm[0].block_hashes) == {11, 12} and rm[0].medium == "L3"
    assert s.used_bytes() <= 3 * one and s.stats().bytes == s.used_bytes()


def test_cluster_server_evictions_become_events(cluster, cstore):
    cluster.config_set("maxmemory", "4mb")
    cluster.config_set("maxmemory-policy", "allkeys-lru")
    try:
        s, ev = cstore(1, watch_evictions=True)
        assert s._watcher.wait_ready(5)
        blk = rand_blocks(1, shape=(64, 1024))  # 256 KiB values
        hs = list(range(500, 560))
        for h in hs:
            s.put_blocks([h], blk)
        deadline = time.time() + 5
        while time.time() < deadline:
            removed = {h for e in ev if isinstance(e, BlockRemoved) for h in e.block_hashes}
            present = {h for h in hs if s.lookup_prefix([h])}
            if removed and removed | present == set(hs):
                break
            time.sleep(0.05)
        assert removed, "no BlockRemoved for server-side evictions"
        assert not removed & present and removed | present == set(hs)
    finally:
        cluster.config_set("maxmemory", "0")


def test_cluster_unreachable_then_recovers(cluster, cstore):
    s, _ = cstore(1, timeout_s=0.3)
    hs, blocks = [1, 2, 3], rand_blocks(3)
    c = L3Connector(s, write_async=False)
    c.save(hs, None, [], blocks)
    assert c.lookup(hs) == 3
    cluster.stop()
    try:
        for op in (lambda: s.lookup_prefix(hs), lambda: s.get_blocks(hs), lambda: s.put_blocks(hs, blocks),
                   lambda: s.stats()):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                op()
            assert time.monotonic() - t0 < 3.0
        t0 = time.monotonic()
        assert c.lookup(hs) == 0 and c.load(hs) is None
        assert time.monotonic() - t0 < 3.0
        assert c.fallback_counts["unavailable"] + c.fallback_counts["timeout"] == 2
    finally:
        cluster.start()
    # same ports and node configs: the cluster comes back (empty: no persistence), the client
    # reloads its slot map and works again
    deadline = time.time() + 10
    while time.time() < deadline:
        c.save(hs, None, [], blocks)
        if c.lookup(hs) == 3:
            break
        time.sleep(0.2)
    assert c.lookup(hs) == 3
    assert [a.tobytes() for a in c.load(hs)] == [b.tobytes() for b in blocks]


def test_cluster_listing_covers_every_node(cstore):
    """The store listing (what a restarted router rebuilds its L3 view from) sees every primary."""
    s, _ = cstore(2)
    hs = list(range(5000, 5040))
    s.put_blocks(hs, rand_blocks(40))
    keys = s.list_visible()
    assert sorted(keys) == sorted((hs[e - 1], 2) for e in range(2, 41, 2))
    assert len({s.r.get_node_from_key(s._key(k)).name for k in keys}) >= 2


def test_live_deployment_survives_a_cluster_node_killed(cluster, tiny_model_dir):
    """Issue 7 §10: one node of the Redis Cluster SIGKILLed under a live deployment. Requests
    keep the oracle's tokens and never hang (store faults -> recompute); after the node is back
    (empty: what it held is lost), the router's L3 view converges — within two requests per
    prompt the planned tiers are the loaded tiers. float32: with the node down a request loads what
    the live nodes answer within the store timeout and computes the rest, in calls of other shapes
    than the lone engine's prefill; in the ordinary mode only float32 keeps its tokens then
    (docs/architecture.md, correctness oracle)."""
    from deploy_util import assert_no_leaks, complete, oracle_tokens, random_prompt, routing_record, start

    max_tokens, bound_s = 8, 30.0
    cluster.flush()
    dep = start(tiny_model_dir, "cpd", kv_store=f"{cluster.url}?timeout_s=0.5", settings={"engine.dtype": "float32"})
    try:
        prompts = [random_prompt(600 + i, 160) for i in range(4)]
        expected = [oracle_tokens(tiny_model_dir, p, max_tokens, dtype="float32") for p in prompts]
        for p, want in zip(prompts, expected):
            assert complete(dep, p, max_tokens)["choices"][0]["token_ids"] == want  # cold: written through
        time.sleep(0.5)
        assert int(_cli(cluster.ports[0], "dbsize").strip() or 0) > 0  # the node to kill holds blocks
        dep.reset_prefix_caches()  # from now on a hit can only come from L3
        cluster.kill_node(0)
        try:
            for p, want in zip(prompts, expected):
                t0 = time.monotonic()
                assert complete(dep, p, max_tokens)["choices"][0]["token_ids"] == want
                assert time.monotonic() - t0 < bound_s
                print(f"node down: request took {time.monotonic() - t0:.2f} s")
        finally:
            cluster.restart_node(0)
        metrics = httpx.get(f"{dep.url}/metrics", timeout=5).text
        print([ln for ln in metrics.splitlines() if ln.startswith("cpd_fallbacks_total")])
        for p, want in zip(prompts, expected):
            for attempt in range(2):
                dep.reset_prefix_caches()
                out = complete(dep, p, max_tokens)
                assert out["choices"][0]["token_ids"] == want
                rec = routing_record(dep, out["id"])
                plan, got = rec["load_plan"], rec["cached_tokens_by_tier"]
                print(f"attempt {attempt}: planned L3 {plan['l3_blocks'] * 16}, loaded {got}")
                if got.get("L3", 0) == plan["l3_blocks"] * 16:
                    break
            else:
                pytest.fail(f"L3 view did not converge after two requests: {rec}")
        assert_no_leaks(dep)
    finally:
        dep.stop()
