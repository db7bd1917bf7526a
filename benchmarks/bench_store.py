"""L3 store bandwidth: our store layer (redis + file backends) vs ``redis-benchmark``.

Starts a private redis-server on a free port (unless ``--url``), then for one value size:
* ``put_blocks`` / ``get_blocks`` of single-block chunks through :mod:`cpd.store`
  (header + xxh3 checksum + redis-py/hiredis), one client, sequential;
* plain redis-py SET/GET of the same sizes (the client-library floor);
* ``redis-benchmark -d SIZE -t set,get -c 1 -P 1`` (SET with ``-r`` for fresh keys) (Debian's tool, C client, same server);
and prints GB/s and the ratio ours / redis-benchmark. The file backend (/dev/shm) is
reported for reference.

Usage: python benchmarks/bench_store.py [--size-mb 1] [--n 200] [--url redis://host:port]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--url", default=None)
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
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
