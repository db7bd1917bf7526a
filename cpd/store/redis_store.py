"""``redis://HOST:PORT[/DB]`` backend (Redis or Valkey, standalone) via redis-py + hiredis; the
Redis Cluster variant lives in :mod:`cpd.store.redis_cluster_store`.

Keys: visible chunk ``<prefix><last_hash:016x>:<n>`` (default prefix ``cpd:kv:``); staging
``<prefix>stage:<...>`` with a TTL of ``stale_timeout_s``. Bookkeeping (only with a capacity
or the eviction watcher): ``{<prefix>meta}:lru`` (sorted set chunk key -> last access, unix
seconds), ``{<prefix>meta}:info`` (hash chunk key -> ``"<size> <hash_hex>,..."``, the value
size and every block hash of the chunk) and ``{<prefix>meta}:used`` (visible bytes). The
three share a hash tag, so one Lua script updates them atomically, in a cluster too.

Protocol:
* :meth:`put_blocks` (the fast path) sends ``SET final value NX`` for every chunk in one
  pipeline (RESP written directly from the array buffers: no payload copy on the client). A Redis command is applied atomically or not at all — a client that dies while
  sending a value leaves nothing (the server drops the incomplete command when the connection
  closes) — so WRITING, SEALED and VISIBLE collapse into one step, and ``NX`` makes the first
  sealer win. This avoids a second round trip and a server-side copy.
* :meth:`begin_write` (the explicit protocol, used where writing and sealing are separate)
  stages the value with ``SETRANGE stage`` + ``PEXPIRE <timeout>`` (a Lua script; a
  continuation fails if the staging key was reclaimed meanwhile), then seals with a Lua script
  that checks the staged length and renames to the final key only if that is absent, then
  ``PERSIST`` — atomic, first wins. A staging key never sealed expires by its TTL (Redis
  reclaims it; no reader looks at it).
* :meth:`lookup_prefix` is one pipelined round trip of ``EXISTS`` per candidate key; reads are
  one pipelined ``GET`` round trip (plus the LRU touches in the same pipeline). Corrupt values
  are deleted by a Lua script only if the value's checksum trailer is unchanged (so a good value
  written meanwhile survives).

Capacity (``capacity_bytes > 0``; the bookkeeping is :mod:`cpd.store.redis_lru`): LRU over visible chunks, shared by every process using the
store (the recency lives in the server's sorted set; reads and writes ``ZADD`` it in the same
pipeline; the clock is the client's wall clock). After a write pushes ``used`` over the
capacity, the writer evicts oldest-first (``DEL`` pipelined; only the process whose ``DEL``
removed a chunk publishes its ``BlockRemoved``, so concurrent evictors never double-report).
All processes sharing a store should use the same ``capacity_bytes`` (a process without it
does not record accesses). Approximate: a chunk read between choosing victims and deleting
them is still evicted.

Redis's own evictions (``maxmemory`` + an eviction policy) and expirations are observed by a
:class:`~cpd.store.redis_watch.EvictionWatcher` (``watch_evictions=True``): it enables
``notify-keyspace-events Exe`` (merged with the current flags) and turns ``evicted``/``expired``
events of chunk keys into ``BlockRemoved(medium="L3")`` naming every block of the chunk (from
the bookkeeping). Events missed while disconnected are lost (the router then learns of them as
stale hits on load). Recommended server setup: ``maxmemory-policy volatile-lru`` plus
``chunk_ttl_s`` (e.g. a day) on the store URL, so that Redis evicts only chunks and never the
bookkeeping keys. With ``allkeys-*`` policies Redis may evict the bookkeeping hash too (its LRU
clock has 1 s resolution); the event then names only the chunk's last block (exact for
``chunk_blocks=1``; for longer chunks the router finds the earlier blocks stale on load).

Timeouts: connect and socket read/write timeouts (per socket operation) default to 0.5 s and
redis-py retries are disabled, so an unreachable or stalled server raises
:class:`StoreUnavailable` (:class:`StoreTimeout` for timeouts) within about a second. A later
call reconnects, so the store recovers by itself once the server is back.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterable, Literal, Sequence

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cpd.store.base import (DEFAULT_STALE_TIMEOUT_S, ChunkKey, EventSink, KVStore, PendingWrite,
                            StoreTimeout, StoreUnavailable)
from cpd.store.chunk_format import encode_parts, header_hashes
from cpd.store.redis_resp import join_parts, part_len, set_nx_many
from cpd.store.redis_lru import RedisLRU
from cpd.store.redis_scripts import RedisScripts

class RedisErrors:
    """Context manager turning client errors into :class:`StoreUnavailable` (:class:`StoreTimeout`
    for timeouts), after calling ``on_error`` (the cluster store reloads its slot map)."""

    __slots__ = ("url", "errors", "on_error")

    def __init__(self, url: str, errors: tuple, on_error: Callable[[], None] | None = None):
        self.url, self.errors, self.on_error = url, errors, on_error

    def __enter__(self) -> "RedisErrors":
        return self

    def __exit__(self, et, ev, tb) -> Literal[False]:
        if et is not None and issubclass(et, self.errors) and not issubclass(et, StoreUnavailable):
            if self.on_error is not None:
                self.on_error()
            if issubclass(et, (redis.TimeoutError, TimeoutError)):
                raise StoreTimeout(f"{self.url}: timeout: {ev!r}") from ev
            raise StoreUnavailable(f"{self.url}: {ev!r}") from ev
        return False


class _RedisWrite(PendingWrite):
    """Staging = a key with a TTL (``SETRANGE`` + ``PEXPIRE`` in one script); seal = a script that
    checks the staged length and renames to the final key only if that is absent."""

    def __init__(self, store: "RedisStore", key: ChunkKey, hashes: Sequence[int], value: bytearray):
        super().__init__(key, hashes, len(value), store.visibility)
        self.store, self.value = store, value
        self.stage = store._stage_key(key)

    def _stage(self, limit: int) -> bool:
        ttl = max(1, int(self.store.stale_timeout_s * 1000))
        with self.store._guard():
            r = self.store.scripts().stage(keys=[self.stage], args=[
                self.written, ttl, memoryview(self.value)[self.written:limit]])
        return r != -1  # -1: staging key expired/reclaimed, this write can never seal

    def _seal_atomic(self) -> bool:
        with self.store._guard():
            r = self.store.scripts().seal(keys=[self.stage, self.store._key(self.key)],
                                          args=[len(self.value), self.store.chunk_ttl_ms])
        if r == 1 and self.store.track:
            self.store.lru.after_write([(self.key, len(self.value), self.hashes)])
        return r == 1

    def _discard(self) -> None:
        try:
            with self.store._guard():
                self.store.r.delete(self.stage)
        except StoreUnavailable:
            pass  # the TTL reclaims it


class RedisStore(KVStore):
    """Client of one Redis server.

    Args:
        host, port, db: server address.
        prefix: key prefix (namespaces several stores on one server).
        timeout_s: connect and socket timeout, seconds.
        chunk_blocks, event_sink, stale_timeout_s, capacity_bytes: see :class:`KVStore`.
        watch_evictions: start an :class:`~cpd.store.redis_watch.EvictionWatcher` thread that
            turns the server's own evictions/expirations into ``BlockRemoved`` events.
        chunk_ttl_s: if > 0, visible chunks expire after this long (``SET ... PX``); with
            ``maxmemory-policy volatile-lru`` this makes only chunks evictable, never the
            bookkeeping keys (which have no TTL).
        evict_batch: chunks examined per eviction round trip.
    Raises:
        StoreUnavailable: never at construction (connections are lazy), on any call thereafter.
    """

    _errors: tuple = (redis.RedisError, OSError)

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, *,
                 prefix: str = "cpd:kv:", timeout_s: float = 0.5, chunk_blocks: int = 1,
                 event_sink: EventSink | None = None,
                 stale_timeout_s: float = DEFAULT_STALE_TIMEOUT_S, capacity_bytes: int = 0,
                 watch_evictions: bool = False, evict_batch: int = 32, chunk_ttl_s: float = 0.0,
                 connection: dict | None = None):
        self.connection = dict(connection or {})  # username, password, ssl options (cpd.store.redis_url)
        super().__init__(chunk_blocks, event_sink, stale_timeout_s, capacity_bytes)
        self.prefix = prefix
        self.db = db
        self.timeout_s = float(timeout_s)
        self.chunk_ttl_ms = int(chunk_ttl_s * 1000)
        self.track = bool(self.capacity_bytes > 0 or watch_evictions)
        self.lru = RedisLRU(self, prefix, int(evict_batch))
        self._watcher = None
        self._init_client(host, port, db)
        if watch_evictions:
            self.start_watcher()

    def _init_client(self, host: str, port: int, db: int) -> None:
        self.url = f"{'rediss' if self.connection.get('ssl') else 'redis'}://{host}:{port}/{db}"
        self._client = redis.Redis(host=host, port=port, db=db, socket_timeout=self.timeout_s,
                             socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 0),
                             health_check_interval=0, **self.connection)
        self._scripts = RedisScripts.register(self._client)

    @property
    def r(self) -> Any:
        """The redis-py client (``redis.Redis``; the cluster store's is a ``RedisCluster``)."""
        return self._client

    def scripts(self) -> RedisScripts:
        """The Lua scripts, registered with this store's client."""
        return self._scripts

    def _pipe(self):
        return self.r.pipeline(transaction=False)

    def _guard(self) -> "RedisErrors":
        return RedisErrors(self.url, self._errors)

    def _key(self, key: ChunkKey) -> str:
        return f"{self.prefix}{key[0]:016x}:{key[1]}"

    def _stage_key(self, key: ChunkKey) -> str:
        return f"{self.prefix}stage:{key[0]:016x}:{key[1]}:{uuid.uuid4().hex[:12]}"

    def _parse(self, name) -> ChunkKey | None:
        if isinstance(name, (bytes, bytearray)):
            name = name.decode()
        if not name.startswith(self.prefix):
            return None
        s = name[len(self.prefix):].strip("{}")
        h, _, n = s.partition(":")
        try:
            return int(h, 16), int(n)
        except ValueError:
            return None

    def ping(self) -> bool:
        """True if the server answers. Raises: StoreUnavailable."""
        with self._guard():
            return bool(self.r.ping())

    # ---- capacity (the LRU bookkeeping lives in cpd.store.redis_lru) -------------------
    def used_bytes(self) -> int:
        """Visible bytes according to the bookkeeping (0 unless tracking). Raises: StoreUnavailable."""
        return self.lru.used_bytes()

    def evict_to(self, max_bytes: int) -> int:
        """LRU eviction down to ``max_bytes`` (requires bookkeeping: capacity or watcher).
        Returns chunks this call evicted. Raises: StoreUnavailable."""
        evicted = self.lru.evict_to(max_bytes)
        self._bump(evicted=evicted)
        return evicted

    # ---- primitives -------------------------------------------------------------------
    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        with self._guard():
            p = self._pipe()
            for k in keys:
                p.exists(self._key(k))
            return [bool(x) for x in p.execute()]

    def _get_many(self, keys: list[ChunkKey]) -> list[object | None]:
        with self._guard():
            if len(keys) == 1 and not self.track:
                return [self.r.get(self._key(keys[0]))]
            p = self._pipe()
            for k in keys:
                p.get(self._key(k))
            if self.track:  # LRU touch in the same round trip (XX: only tracked keys)
                now = time.time()
                p.zadd(self.lru.keys[0], {self._key(k): now for k in keys}, xx=True)
            return p.execute()[:len(keys)]

    def _put_many(self, items: list[tuple[ChunkKey, list]]) -> list[bool]:
        with self._guard():
            replies = set_nx_many(self.r.connection_pool,
                                       [(self._key(key).encode(), parts) for key, parts in items],
                                       self.chunk_ttl_ms)
        won = [r is not None and not isinstance(r, Exception) for r in replies]
        if self.track:
            self.lru.after_write(self._written(items, won))
        return won

    @staticmethod
    def _written(items, won) -> list[tuple[ChunkKey, int, list[int]]]:
        out = []
        for (key, parts), w in zip(items, won):
            if w:
                out.append((key, sum(part_len(p) for p in parts), header_hashes(parts[0]) or [key[0]]))
        return out

    def _invalidate(self, key: ChunkKey, trailer: bytes | None) -> bool:
        try:
            with self._guard():
                if trailer is None:
                    ok = bool(self.r.delete(self._key(key)))
                else:
                    ok = bool(self.scripts().invalidate(keys=[self._key(key)], args=[trailer]))
            if ok and self.track:
                self.lru.forget([self._key(key)])
            return ok
        except StoreUnavailable:
            return False

    def _delete_keys(self, keys: list[ChunkKey]) -> list[bool]:
        with self._guard():
            p = self._pipe()
            for k in keys:
                p.delete(self._key(k))
            gone = [bool(x) for x in p.execute()]
        if self.track:
            self.lru.forget([self._key(k) for k, g in zip(keys, gone) if g])
        return gone

    def _scan_names(self, match: str) -> list:
        return list(self.r.scan_iter(match=match, count=1000))

    def list_visible(self) -> list[ChunkKey]:
        """Chunk keys from ``SCAN`` (every primary of a cluster), without the size round trip."""
        stage = f"{self.prefix}stage:".encode()
        with self._guard():
            names = self._scan_names(f"{self.prefix}*")
        keys = (self._parse(n) for n in names if not n.startswith(stage))
        return [k for k in keys if k is not None]

    def _scan(self) -> Iterable[tuple[ChunkKey, int]]:
        with self._guard():
            names = [n for n in self._scan_names(f"{self.prefix}*")
                     if not n.startswith(f"{self.prefix}stage:".encode())]
            if not names:
                return []
            p = self._pipe()
            for n in names:
                p.strlen(n)
            sizes = p.execute()
        out = []
        for n, sz in zip(names, sizes):
            k = self._parse(n)
            if k is not None and sz:
                out.append((k, int(sz)))
        return out

    def clear(self) -> int:
        n = super().clear()
        with self._guard():
            self.r.delete(*self.lru.keys)
        return n

    def begin_write(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray],
                    block_size: int | None = None) -> PendingWrite:
        if len(block_hashes) > self.chunk_blocks:
            raise ValueError("more blocks than chunk_blocks")
        hs = [int(h) for h in block_hashes]
        return _RedisWrite(self, (hs[-1], len(hs)), hs, join_parts(encode_parts(hs, blocks, block_size)))

    def reclaim_stale(self, max_age_s: float | None = None) -> int:
        """Staging keys expire by their TTL; with ``max_age_s == 0`` they are deleted now
        (used by :meth:`clear`). Returns keys deleted."""
        if max_age_s is None or max_age_s > 0:
            return 0
        with self._guard():
            names = self._scan_names(f"{self.prefix}stage:*")
            n = 0
            if names:
                p = self._pipe()
                for nm in names:
                    p.delete(nm)
                n = sum(p.execute())
        self._bump(reclaimed=n)
        return n

    # ---- watcher ----------------------------------------------------------------------
    def _watch_nodes(self) -> list[tuple[str, int]]:
        c = self.r.connection_pool.connection_kwargs
        return [(c.get("host", "127.0.0.1"), int(c.get("port", 6379)))]

    def on_server_removed(self, name) -> bool:
        """Handle a key the server evicted/expired: if it is a chunk key, forget its
        bookkeeping and publish ``BlockRemoved`` for all its blocks. Returns True if published."""
        if isinstance(name, (bytes, bytearray)):
            name = name.decode()
        if name.startswith(f"{self.prefix}stage:"):
            return False
        k = self._parse(name)
        if k is None:
            return False
        infos = [None]
        if self.track:
            try:
                infos = self.lru.forget([name]) or [None]
            except StoreUnavailable:
                infos = [None]
        self.lru.announce_removed([k], infos)
        self._bump(evicted=1)
        return True

    def start_watcher(self):
        """Start (once) the eviction watcher thread(s); returns the watcher."""
        if self._watcher is None:
            from cpd.store.redis_watch import EvictionWatcher
            self._watcher = EvictionWatcher(self)
            self._watcher.start()
        return self._watcher

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        try:
            self.r.close()
        except Exception:
            pass
