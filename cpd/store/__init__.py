"""L3 KV store: one interface (:class:`KVStore`), backends ``file://DIR`` and
``redis://HOST:PORT[/DB]``, and the engine-facing :class:`~cpd.store.connector.L3Connector`.

See :mod:`cpd.store.base` for keys, chunking, the value wire format and the visibility
protocol (DESIGN §4)."""
from __future__ import annotations

from urllib.parse import parse_qs, urlparse

from cpd.store.base import (DEFAULT_STALE_TIMEOUT_S, EventSink, KVStore, PendingWrite, StoreStats,
                            StoreUnavailable)

__all__ = ["KVStore", "PendingWrite", "StoreStats", "StoreUnavailable", "open_store"]


def open_store(url: str, *, event_sink: EventSink | None = None, chunk_blocks: int | None = None,
               stale_timeout_s: float | None = None, timeout_s: float | None = None) -> KVStore:
    """Open a store from a URL.

    URLs: ``file:///dev/shm/cpd-kv`` (or ``file://relative/dir``) and
    ``redis://host:port[/db]``. Query parameters: ``chunk_blocks`` (int, default 1),
    ``stale_timeout_s`` (float, default 30), ``timeout_s`` (redis only, default 0.5),
    ``prefix`` (redis key prefix, default ``cpd:kv:``). Keyword arguments override the query.

    Raises:
        ValueError: unknown scheme.
        StoreUnavailable: the file store's directory cannot be created.
    """
    u = urlparse(url)
    q = {k: v[-1] for k, v in parse_qs(u.query).items()}
    cb = chunk_blocks if chunk_blocks is not None else int(q.get("chunk_blocks", 1))
    st = stale_timeout_s if stale_timeout_s is not None else float(
        q.get("stale_timeout_s", DEFAULT_STALE_TIMEOUT_S))
    if u.scheme == "file":
        from cpd.store.file_store import FileStore
        return FileStore(u.netloc + u.path, chunk_blocks=cb, event_sink=event_sink, stale_timeout_s=st)
    if u.scheme == "redis":
        from cpd.store.redis_store import RedisStore
        db = int(u.path.strip("/") or 0)
        to = timeout_s if timeout_s is not None else float(q.get("timeout_s", 0.5))
        return RedisStore(u.hostname or "127.0.0.1", u.port or 6379, db, prefix=q.get("prefix", "cpd:kv:"),
                          timeout_s=to, chunk_blocks=cb, event_sink=event_sink, stale_timeout_s=st)
    raise ValueError(f"unknown store URL scheme: {url!r}")
