"""L3 KV store: one interface (:class:`KVStore`), backends ``file://DIR``, ``redis://HOST:PORT[/DB]``
and ``redis+cluster://HOST:PORT[,HOST:PORT...]``, and the engine-facing
:class:`~cpd.store.connector.L3Connector`.

One concept per module: :mod:`~cpd.store.base` (the interface), :mod:`~cpd.store.chunk_keys`
(keys and chunking), :mod:`~cpd.store.chunk_format` (the value format and checksum),
:mod:`~cpd.store.visibility` (the ALLOCATED -> WRITING -> SEALED -> VISIBLE -> EVICTED protocol
every backend goes through, and its announcements), :mod:`~cpd.store.errors`,
:mod:`~cpd.store.capacity` (default capacity), :mod:`~cpd.store.sizes`, and the backends
(:mod:`~cpd.store.file_store`; :mod:`~cpd.store.redis_store` with its scripts
:mod:`~cpd.store.redis_scripts`, raw writer :mod:`~cpd.store.redis_resp`, URL options
:mod:`~cpd.store.redis_url`, eviction watcher :mod:`~cpd.store.redis_watch`, and the cluster
variant :mod:`~cpd.store.redis_cluster_store`)."""
from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from cpd.store.base import (DEFAULT_STALE_TIMEOUT_S, EventSink, KVStore, PendingWrite, StoreStats,
                            StoreTimeout, StoreUnavailable)
from cpd.store.sizes import parse_size

__all__ = ["KVStore", "PendingWrite", "StoreStats", "StoreTimeout", "StoreUnavailable", "open_store",
           "parse_size"]

_TRUE = {"1", "true", "yes", "on"}

from cpd.store.redis_url import connection_kwargs  # noqa: E402  (user, password, TLS of redis URLs)


def _hosts(netloc: str) -> list[tuple[str, int]]:
    out = []
    for hp in netloc.rpartition("@")[2].split(","):
        if not hp:
            continue
        h, _, p = hp.rpartition(":")
        out.append((h or "127.0.0.1", int(p)) if h else (hp, 6379))
    return out or [("127.0.0.1", 6379)]


def _make_dir(root: str) -> None:
    import os
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise StoreUnavailable(f"file://{root}: {e}") from e


STORE_URL_SCHEMES = ("file", "mem", "redis", "rediss", "redis+cluster", "rediss+cluster")  # open_store's


def open_store(url: str, *, event_sink: EventSink | None = None, chunk_blocks: int | None = None,
               stale_timeout_s: float | None = None, timeout_s: float | None = None,
               capacity_bytes: int | None = None, watch_evictions: bool | None = None) -> KVStore:
    """Open a store from a URL.

    URLs: ``file:///dev/shm/cpd-kv`` (or ``file://relative/dir``), ``mem://NAME`` (this
    process's memory, :mod:`cpd.store.mem_store`), ``redis://host:port[/db]``
    (standalone) and ``redis+cluster://host:port[,host:port...]`` (Redis Cluster; the listed
    nodes are seeds, the rest is discovered; also ``redis://host:port?cluster=1``).

    Query parameters (keyword arguments override them):

    * ``chunk_blocks`` (int, default 1): blocks per stored value. 1 = block-granular hits and
      the most keys/round-trip work per block; larger values (4-16) cut per-value overhead
      (one key, header, checksum, server entry per chunk) and suit long shared prefixes, but a
      prefix is found only up to the last whole chunk it contains, and every process sharing a
      store must use the same value.
    * ``capacity_bytes`` (int or ``512M``/``2G``; ``0`` = unlimited): LRU eviction over
      visible chunks above this size, publishing ``BlockRemoved``; all processes sharing a
      store should use the same value. Default: ``file://`` stores get a capacity sized from
      the machine (:mod:`cpd.store.capacity`: half the filesystem's free space plus what the
      store holds, at most a quarter of RAM on tmpfs, between 64 MiB and 64 GiB); Redis
      stores default to 0 and are bounded by the server's own ``maxmemory`` (use
      ``watch_evictions=1`` to turn its evictions into events).
    * ``stale_timeout_s`` (float, default 30): reclaim age of abandoned staging data.
    * ``timeout_s`` (redis, default 0.5): connect/socket timeout; a slower store is a miss.
    * ``prefix`` (redis, default ``cpd:kv:``): key prefix.
    * ``watch_evictions`` (redis, 0/1, default 0): turn the server's own maxmemory evictions
      into ``BlockRemoved`` events (keyspace notifications, background thread).
    * ``chunk_ttl_s`` (redis, default 0 = none): chunks expire after this long; use with
      ``maxmemory-policy volatile-lru`` so Redis evicts only chunks, never the bookkeeping.
    * ``evict_interval_s`` (file, default 5): how often a writer rescans the directory for
      data written by other processes when enforcing ``capacity_bytes``.

    Raises:
        ValueError: unknown scheme.
        StoreUnavailable: the file store's directory cannot be created.
    """
    u = urlsplit(url)
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    cb = chunk_blocks if chunk_blocks is not None else int(q.get("chunk_blocks", 1))
    st = stale_timeout_s if stale_timeout_s is not None else float(
        q.get("stale_timeout_s", DEFAULT_STALE_TIMEOUT_S))
    cap = capacity_bytes if capacity_bytes is not None else (
        parse_size(q["capacity_bytes"]) if "capacity_bytes" in q else None)
    if u.scheme == "file":
        from cpd.store.file_store import FileStore
        root = u.netloc + u.path
        if cap is None:
            from cpd.store.capacity import machine_default_capacity_bytes
            _make_dir(root)
            cap = machine_default_capacity_bytes(root)
        return FileStore(root, chunk_blocks=cb, event_sink=event_sink, stale_timeout_s=st,
                         capacity_bytes=cap, evict_interval_s=float(q.get("evict_interval_s", 5.0)))
    if u.scheme == "mem":  # process-local (cpd.store.mem_store): the simulator, single-process setups
        from cpd.store.mem_store import MemStore
        return MemStore(u.netloc + u.path or "default", chunk_blocks=cb, event_sink=event_sink,
                        stale_timeout_s=st, capacity_bytes=cap or 0)
    if u.scheme in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        to = timeout_s if timeout_s is not None else float(q.get("timeout_s", 0.5))
        we = watch_evictions if watch_evictions is not None else q.get("watch_evictions", "0").lower() in _TRUE
        kw: dict[str, Any] = dict(prefix=q.get("prefix", "cpd:kv:"), timeout_s=to, chunk_blocks=cb, event_sink=event_sink,
                  stale_timeout_s=st, capacity_bytes=cap or 0, watch_evictions=we,
                  chunk_ttl_s=float(q.get("chunk_ttl_s", 0)), connection=connection_kwargs(u, q))
        if u.scheme not in ("redis", "rediss") or q.get("cluster", "0").lower() in _TRUE:
            from cpd.store.redis_cluster_store import RedisClusterStore
            return RedisClusterStore(_hosts(u.netloc), **kw)
        from cpd.store.redis_store import RedisStore
        db = int(u.path.strip("/") or 0)
        return RedisStore(u.hostname or "127.0.0.1", u.port or 6379, db, **kw)
    raise ValueError(f"unknown store URL scheme: {url!r} (known: {', '.join(STORE_URL_SCHEMES)})")
