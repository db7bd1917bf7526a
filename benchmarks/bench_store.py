"""L3 store bandwidth: our store layer (redis + file backends) vs ``redis-benchmark``.

Starts a private redis-server on a free port (unless ``--url``), then for one value size:
* ``put_blocks`` / ``get_blocks`` of single-block chunks through :mod:`cpd.store`
  (header + xxh3 checksum + redis-py/hiredis), one client, sequential;
* plain redis-py SET/GET of the same sizes (the client-library floor);
* ``redis-benchmark -d SIZE -t set,get -c 1 -P 1`` (SET with ``-r`` for fresh keys) (Debian's tool, C client, same server);
and prints GB/s and the ratio ours / redis-benchmark. The file backend (/dev/shm) is
reported for reference.

Also: batched reads/writes (one ``put_blocks``/``get_blocks`` call of many 64 KiB blocks, pipelined)
with ``chunk_blocks`` 1 and 8, with LRU bookkeeping on (``capacity_bytes``), and on a local
3-node Redis Cluster (``--cluster``; started with redis-cli --cluster create).

Usage: python benchmarks/bench_store.py [--size-mb 1] [--n 200] [--url redis://host:port] [--cluster]
"""
from __future__ import annotations

import argparse
import csv
import io
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np

from cpd.store import open_store
from cpd.deploy import free_port


def bench_store(store, size: int, n: int, rounds: int = 3) -> tuple[float, float]:
    floats = size // 4
    blk = np.random.default_rng(0).standard_normal(floats).astype(np.float32)
    best_put = best_get = 0.0
    for r in range(rounds):
        store.clear()
        hs = [(r << 32) + i + 1 for i in range(n)]
        t0 = time.perf_counter()
        for h in hs:
            store.put_blocks([h], [blk])
        t1 = time.perf_counter()
        for h in hs:
            got = store.get_blocks([h])
            assert got is not None
        t2 = time.perf_counter()
        best_put = max(best_put, n * size / (t1 - t0) / 1e9)
        best_get = max(best_get, n * size / (t2 - t1) / 1e9)
    store.clear()
    return best_put, best_get


def bench_raw_redis_py(store, size: int, n: int, rounds: int = 3) -> tuple[float, float]:
    """Plain redis-py SET/GET of the same sizes (no header, checksum or numpy): the client floor."""
    r = store.r
    v = np.random.default_rng(0).bytes(size)
    best_put = best_get = 0.0
    for k in range(rounds):
        keys = [f"raw:{k}:{i}" for i in range(n)]
        t0 = time.perf_counter()
        for key in keys:
            r.set(key, v)
        t1 = time.perf_counter()
        for key in keys:
            r.get(key)
        t2 = time.perf_counter()
        r.delete(*keys)
        best_put = max(best_put, n * size / (t1 - t0) / 1e9)
        best_get = max(best_get, n * size / (t2 - t1) / 1e9)
    return best_put, best_get


def redis_benchmark(port: int, size: int, n: int) -> dict[str, float]:
    """GB/s of ``redis-benchmark``: SET over random keys (``-r``; new keys, as our puts),
    GET of the key the plain run wrote (``-r`` would make GETs miss)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    res = {}
    for tests, extra, want in (("set", ["-r", "1000000"], "SET"), ("set,get", [], "GET")):
        out = subprocess.run([exe, "-h", "127.0.0.1", "-p", str(port), "-d", str(size), "-t", tests,
                              "-n", str(n), "-c", "1", "-P", "1", "--csv", *extra],
                             capture_output=True, text=True, timeout=600).stdout
        for row in csv.reader(io.StringIO(out)):
            if row and row[0] == want:
                res[want] = float(row[1]) * size / 1e9
    return res


def bench_batched(store, block_bytes: int = 64 << 10, n_blocks: int = 256, rounds: int = 3) -> tuple[float, float]:
    """GB/s of one put_blocks / get_blocks call over ``n_blocks`` blocks (pipelined batches)."""
    rng = np.random.default_rng(1)
    blocks = [rng.standard_normal(block_bytes // 4).astype(np.float32) for _ in range(n_blocks)]
    best_put = best_get = 0.0
    for r in range(rounds):
        store.clear()
        hs = [(r << 40) + i + 1 for i in range(n_blocks)]
        t0 = time.perf_counter()
        assert store.put_blocks(hs, blocks) == n_blocks
        t1 = time.perf_counter()
        assert store.get_blocks(hs) is not None
        t2 = time.perf_counter()
        best_put = max(best_put, n_blocks * block_bytes / (t1 - t0) / 1e9)
        best_get = max(best_get, n_blocks * block_bytes / (t2 - t1) / 1e9)
    store.clear()
    return best_put, best_get


def start_cluster(tmp: str) -> tuple[list[subprocess.Popen], str]:
    import os
    import random
    ports: list[int] = []
    while len(ports) < 3:
        p = random.randrange(10000, 22000)  # P and P+10000 below the ephemeral range
        ok = True
        for q in (p, p + 10000):
            with socket.socket() as sk:
                try:
                    sk.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
        if ok and p not in ports:
            ports.append(p)
    procs = []
    for p in ports:
        d = os.path.join(tmp, f"c{p}")
        os.makedirs(d)
        procs.append(subprocess.Popen(["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", d, "--cluster-enabled", "yes",
                                       "--cluster-config-file", "nodes.conf"], stdout=subprocess.DEVNULL))
    for p in ports:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", p), 0.2).close()
                break
            except OSError:
                time.sleep(0.05)
    subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports],
                    "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, timeout=60, check=True)
    for _ in range(200):
        if all("cluster_state:ok" in subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"],
                                                    capture_output=True, text=True).stdout for p in ports):
            break
        time.sleep(0.1)
    return procs, "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--url", default=None)
    ap.add_argument("--cluster", action="store_true", help="also benchmark a local 3-node Redis Cluster")
    a = ap.parse_args()
    size = int(a.size_mb * (1 << 20))
    proc = None
    tmp = tempfile.mkdtemp()
    if a.url is None:
        port = free_port()
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}"
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.05)
    else:
        url = a.url
        port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        rs = open_store(url, timeout_s=10.0)
        put, get = bench_store(rs, size, a.n)
        raw_put, raw_get = bench_raw_redis_py(rs, size, a.n)
        rb = redis_benchmark(port, size, a.n)
        fdir = tempfile.mkdtemp(dir="/dev/shm")
        fput, fget = bench_store(open_store(f"file://{fdir}"), size, a.n)
        shutil.rmtree(fdir, ignore_errors=True)
        print(f"value size {size} B, {a.n} values, 1 client")
        print(f"cpd redis store : SET {put:6.2f} GB/s   GET {get:6.2f} GB/s")
        print(f"raw redis-py    : SET {raw_put:6.2f} GB/s   GET {raw_get:6.2f} GB/s")
        if rb:
            print(f"redis-benchmark : SET {rb['SET']:6.2f} GB/s   GET {rb['GET']:6.2f} GB/s")
            print(f"ratio cpd/redis-benchmark: SET {put / rb['SET']:.2f}   GET {get / rb['GET']:.2f}")
        print(f"cpd file store (/dev/shm): SET {fput:6.2f} GB/s   GET {fget:6.2f} GB/s")
        print("batched: one call of 256 x 64 KiB blocks (pipelined)")
        for label, kw in (("redis chunk_blocks=1", {}), ("redis chunk_blocks=8", {"chunk_blocks": 8}),
                          ("redis chunk_blocks=8 +LRU", {"chunk_blocks": 8, "capacity_bytes": 1 << 40})):
            st = open_store(url, timeout_s=10.0, **kw)
            bp, bg = bench_batched(st)
            st.close()
            print(f"  {label:28s}: SET {bp:6.2f} GB/s   GET {bg:6.2f} GB/s")
        if a.cluster:
            procs, curl = start_cluster(tmp)
            try:
                cs = open_store(curl, timeout_s=10.0)
                cput, cget = bench_store(cs, size, a.n)
                print(f"cpd redis cluster (3 nodes), {size} B values: SET {cput:6.2f} GB/s   GET {cget:6.2f} GB/s")
                for label, kw in (("cluster chunk_blocks=1", {}), ("cluster chunk_blocks=8", {"chunk_blocks": 8})):
                    st = open_store(curl, timeout_s=10.0, **kw)
                    bp, bg = bench_batched(st)
                    st.close()
                    print(f"  {label:28s}: SET {bp:6.2f} GB/s   GET {bg:6.2f} GB/s")
                cs.close()
            finally:
                for pr in procs:
                    pr.terminate()
                for pr in procs:
                    pr.wait(10)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
