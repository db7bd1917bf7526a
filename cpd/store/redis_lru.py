"""LRU bookkeeping of a Redis store, shared by every process using it (capacity and the
eviction watcher need it).

Keys (one hash tag, so one Lua script updates them atomically, in a cluster too):
``{<prefix>meta}:lru`` (sorted set chunk key -> last access, unix seconds),
``{<prefix>meta}:info`` (hash chunk key -> ``"<size> <hash_hex>,..."``: the value size and every
block hash of the chunk) and ``{<prefix>meta}:used`` (visible bytes). Reads and writes bump the
recency in the same round trip as the data (the clock is the client's wall clock). After a write
pushes ``used`` over the capacity, the writer evicts oldest-first (``DEL`` pipelined); only the
process whose ``DEL`` removed a chunk announces it (:meth:`Visibility.evicted_chunk`), so
concurrent evictors never double-report. Approximate: a chunk read between choosing victims and
deleting them is still evicted.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

from cpd.store.chunk_keys import ChunkKey

if TYPE_CHECKING:
    from cpd.store.redis_store import RedisStore

MAX_EVICTION_ROUNDS = 10000


def _info(size: int, hashes: Sequence[int]) -> str:
    return f"{size} " + ",".join(f"{int(h):x}" for h in hashes)


def _info_hashes(info: Any) -> list[int]:
    if info is None:
        return []
    s = info.decode() if isinstance(info, (bytes, bytearray)) else str(info)
    _, _, hs = s.partition(" ")
    return [int(h, 16) for h in hs.split(",") if h]


class RedisLRU:
    """The bookkeeping of one store client (``store`` provides the client, keys and scripts)."""

    def __init__(self, store: "RedisStore", prefix: str, evict_batch: int):
        self.store = store
        meta = "{" + prefix + "meta}"
        self.keys = [f"{meta}:lru", f"{meta}:info", f"{meta}:used"]
        self.evict_batch = evict_batch

    def record(self, written: list[tuple[ChunkKey, int, list[int]]]) -> int:
        """Record values this client made visible; returns bytes used (store-wide)."""
        st = self.store
        args: list = [repr(time.time())]
        for key, size, hs in written:
            args += [st._key(key), _info(size, hs or [key[0]])]
        with st._guard():
            return int(st.scripts().account(keys=self.keys, args=args))

    def forget(self, names: list[str]) -> list:
        """Drop bookkeeping of gone chunk keys; returns each one's info (or None)."""
        if not names:
            return []
        with self.store._guard():
            return list(self.store.scripts().forget(keys=self.keys, args=names))

    def announce_removed(self, keys: list[ChunkKey], infos: list) -> None:
        """One ``BlockRemoved`` per removed chunk naming its blocks (from the bookkeeping; just
        the last hash when that is gone)."""
        for k, info in zip(keys, infos):
            self.store.visibility.evicted_chunk(k, _info_hashes(info))

    def used_bytes(self) -> int:
        with self.store._guard():
            return int(self.store.r.get(self.keys[2]) or 0)

    def evict_to(self, max_bytes: int) -> int:
        """Evict oldest-first down to ``max_bytes``; returns chunks this call removed."""
        st = self.store
        evicted = 0
        for _ in range(MAX_EVICTION_ROUNDS):
            with st._guard():
                names = [n.decode() for n in st.scripts().pick(keys=self.keys,
                                                             args=[int(max_bytes), self.evict_batch])]
                if not names:
                    break
                p = st._pipe()
                for n in names:
                    p.delete(n)
                gone = p.execute()
            infos = self.forget(names)
            keys, inf = [], []
            for n, g, info in zip(names, gone, infos):
                k = st._parse(n)
                if g and k is not None:
                    keys.append(k)
                    inf.append(info)
            evicted += len(keys)
            self.announce_removed(keys, inf)
        return evicted

    def after_write(self, written: list[tuple[ChunkKey, int, list[int]]]) -> None:
        """Record what a write made visible, then evict if that pushed the store over capacity."""
        if not written:
            return
        used = self.record(written)
        if self.store.capacity_bytes and used > self.store.capacity_bytes:
            self.store.evict_to(self.store.capacity_bytes)
