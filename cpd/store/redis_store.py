"""``redis://HOST:PORT[/DB]`` backend (Redis or Valkey, standalone) via redis-py + hiredis.

Keys: visible chunk ``<prefix><last_hash:016x>:<n>`` (default prefix ``cpd:kv:``); staging
``<prefix>stage:<...>`` with a TTL of ``stale_timeout_s``.

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
  one pipelined ``GET`` round trip. Corrupt values are deleted by a Lua script only if the
  value's checksum trailer is unchanged (so a good value written meanwhile survives).
* Evictions done by Redis itself (``maxmemory-policy allkeys-lru``) produce no
  ``BlockRemoved`` events; the router learns of them as stale hits on load.

Timeouts: connect and socket read/write timeouts default to 0.5 s and redis-py retries are
disabled, so an unreachable server raises :class:`StoreUnavailable` within about a second.
"""
from __future__ import annotations

import uuid
from typing import Iterable, Sequence

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cpd.store.base import (DEFAULT_STALE_TIMEOUT_S, ChunkKey, EventSink, KVStore, PendingWrite,
                            StoreUnavailable, encode_parts)

# KEYS[1]=staging key; ARGV: offset, ttl_ms, bytes. A continuation of a reclaimed (expired)
# staging key fails instead of recreating a zero-padded value.
_STAGE_LUA = """
if tonumber(ARGV[1]) > 0 and redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then return -1 end
redis.call('SETRANGE', KEYS[1], ARGV[1], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS: staging, final; ARGV: expected length. Seal = atomic rename-if-absent of a complete value.
_SEAL_LUA = """
if redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then redis.call('DEL', KEYS[1]) return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DEL', KEYS[1]) return 0 end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('PERSIST', KEYS[2])
return 1
"""

_INVALIDATE_LUA = """
local t = redis.call('GETRANGE', KEYS[1], -8, -1)
if t == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _join(parts: list) -> bytearray:
    out = bytearray(sum(len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes for p in parts))
    pos = 0
    for p in parts:
        ln = len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes
        out[pos:pos + ln] = p
        pos += ln
    return out


class _RedisWrite(PendingWrite):
    def __init__(self, store: "RedisStore", key: ChunkKey, value: bytearray):
        self.store, self.key, self.value = store, key, value
        self.stage = f"{store.prefix}stage:{key[0]:016x}:{key[1]}:{uuid.uuid4().hex[:12]}"
        self.written = 0
        self.done = False
        self.lost = False

    def write(self, fraction: float = 1.0) -> None:
        limit = int(len(self.value) * min(max(fraction, 0.0), 1.0))
        if self.lost or limit <= self.written:
            return
        ttl = max(1, int(self.store.stale_timeout_s * 1000))
        with self.store._guard():
            r = self.store._stage(keys=[self.stage], args=[
                self.written, ttl, memoryview(self.value)[self.written:limit]])
        if r == -1:
            self.lost = True  # staging key expired/reclaimed: this write can never seal
            return
        self.written = limit

    def seal(self) -> bool:
        if self.done:
            return False
        self.done = True
        if self.lost or self.written < len(self.value):
            self.abort()
            return False
        with self.store._guard():
            r = self.store._seal(keys=[self.stage, self.store._key(self.key)], args=[len(self.value)])
        return r == 1

    def abort(self) -> None:
        self.done = True
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
        chunk_blocks, event_sink, stale_timeout_s: see :class:`KVStore`.
    Raises:
        StoreUnavailable: never at construction (connections are lazy), on any call thereafter.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, *,
                 prefix: str = "cpd:kv:", timeout_s: float = 0.5, chunk_blocks: int = 1,
                 event_sink: EventSink | None = None,
                 stale_timeout_s: float = DEFAULT_STALE_TIMEOUT_S):
        super().__init__(chunk_blocks, event_sink, stale_timeout_s)
        self.prefix = prefix
        self.url = f"redis://{host}:{port}/{db}"
        self.r = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                             socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                             health_check_interval=0)
        self._inval = self.r.register_script(_INVALIDATE_LUA)
        self._stage = self.r.register_script(_STAGE_LUA)
        self._seal = self.r.register_script(_SEAL_LUA)

    # errors -> StoreUnavailable
    class _Guard:
        __slots__ = ("url",)

        def __init__(self, url):
            self.url = url

        def __enter__(self):
            return self

        def __exit__(self, et, ev, tb):
            if et is not None and issubclass(et, (redis.RedisError, OSError)):
                raise StoreUnavailable(f"{self.url}: {ev!r}") from ev
            return False

    def _guard(self) -> "_Guard":
        return RedisStore._Guard(self.url)

    def _key(self, key: ChunkKey) -> str:
        return f"{self.prefix}{key[0]:016x}:{key[1]}"

    def _parse(self, name: bytes) -> ChunkKey | None:
        s = name.decode()[len(self.prefix):]
        h, _, n = s.partition(":")
        try:
            return int(h, 16), int(n)
        except ValueError:
            return None

    def ping(self) -> bool:
        """True if the server answers. Raises: StoreUnavailable."""
        with self._guard():
            return bool(self.r.ping())

    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        with self._guard():
            p = self.r.pipeline(transaction=False)
            for k in keys:
                p.exists(self._key(k))
            return [bool(x) for x in p.execute()]

    def _get_many(self, keys: list[ChunkKey]) -> list[object | None]:
        with self._guard():
            if len(keys) == 1:
                return [self.r.get(self._key(keys[0]))]
            p = self.r.pipeline(transaction=False)
            for k in keys:
                p.get(self._key(k))
            return p.execute()

    def _put_many(self, items: list[tuple[ChunkKey, list]]) -> list[bool]:
        # ``SET key value NX`` written as raw RESP straight from the numpy buffers (no join,
        # no hiredis packing copy), all commands pipelined, then all replies read.
        pool = self.r.connection_pool
        with self._guard():
            conn = pool.get_connection()
            try:
                for key, parts in items:
                    k = self._key(key).encode()
                    vlen = sum(len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes for p in parts)
                    hdr = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, vlen)
                    conn.send_packed_command([hdr, *parts, b"\r\n$2\r\nNX\r\n"])
                replies = [conn.read_response() for _ in items]
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)
        return [r is not None and not isinstance(r, Exception) for r in replies]

    def _invalidate(self, key: ChunkKey, trailer: bytes | None) -> bool:
        try:
            with self._guard():
                if trailer is None:
                    return bool(self.r.delete(self._key(key)))
                return bool(self._inval(keys=[self._key(key)], args=[trailer]))
        except StoreUnavailable:
            return False

    def _delete_keys(self, keys: list[ChunkKey]) -> list[bool]:
        with self._guard():
            p = self.r.pipeline(transaction=False)
            for k in keys:
                p.delete(self._key(k))
            return [bool(x) for x in p.execute()]

    def _scan(self) -> Iterable[tuple[ChunkKey, int]]:
        with self._guard():
            names = [n for n in self.r.scan_iter(match=f"{self.prefix}*", count=1000)
                     if not n.startswith(f"{self.prefix}stage:".encode())]
            if not names:
                return []
            p = self.r.pipeline(transaction=False)
            for n in names:
                p.strlen(n)
            sizes = p.execute()
        out = []
        for n, sz in zip(names, sizes):
            k = self._parse(n)
            if k is not None and sz:
                out.append((k, int(sz)))
        return out

    def begin_write(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray],
                    block_size: int | None = None) -> PendingWrite:
        if len(block_hashes) > self.chunk_blocks:
            raise ValueError("more blocks than chunk_blocks")
        hs = [int(h) for h in block_hashes]
        return _RedisWrite(self, (hs[-1], len(hs)), _join(encode_parts(hs, blocks, block_size)))

    def reclaim_stale(self, max_age_s: float | None = None) -> int:
        """Staging keys expire by their TTL; with ``max_age_s == 0`` they are deleted now
        (used by :meth:`clear`). Returns keys deleted."""
        if max_age_s is None or max_age_s > 0:
            return 0
        with self._guard():
            names = list(self.r.scan_iter(match=f"{self.prefix}stage:*", count=1000))
            n = self.r.delete(*names) if names else 0
        self._bump(reclaimed=n)
        return n

    def close(self) -> None:
        try:
            self.r.close()
        except Exception:
            pass

