"""``mem://NAME`` backend: chunks in this process's memory (one dict per store name).

The same value format, keys and visibility protocol as the other backends
(:mod:`cpd.store.chunk_format`, :mod:`cpd.store.chunk_keys`, :mod:`cpd.store.visibility`),
with no I/O: ALLOCATED = a staging buffer is created; WRITING = bytes are appended to it;
SEALED+VISIBLE = the whole value is put under its key if the key is absent (first sealer
wins, under one lock). Clients opened with the same ``NAME`` in one process share the data
(several engines of one process, the simulator, tests); other processes do not see it.
:meth:`KVStore.put_blocks` has every value whole and seals each in one step (put-if-absent of
the joined value, as Redis's ``SET NX``); :meth:`MemStore.begin_write` stages part by part.

Capacity (``capacity_bytes > 0``): exact LRU over visible chunks (reads refresh recency),
enforced after every write; each eviction publishes ``BlockRemoved`` naming every block of the
chunk. Staging buffers belong to their writer (a writer that never seals leaves nothing
behind), so :meth:`MemStore.reclaim_stale` has nothing to reclaim.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np

from cpd.store.base import DEFAULT_STALE_TIMEOUT_S, ChunkKey, EventSink, KVStore, PendingWrite
from cpd.store.chunk_format import encode_parts, header_hashes


class _Space:
    """The chunks of one store name: key -> (value bytes, block hashes), LRU order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.chunks: OrderedDict[ChunkKey, tuple[bytes, list[int]]] = OrderedDict()
        self.bytes = 0


_SPACES: dict[str, _Space] = {}
_SPACES_LOCK = threading.Lock()


def _space(name: str) -> _Space:
    with _SPACES_LOCK:
        sp = _SPACES.get(name)
        if sp is None:
            sp = _SPACES[name] = _Space()
        return sp


def drop_space(name: str) -> None:
    """Forget all data of store ``name`` in this process (no events)."""
    with _SPACES_LOCK:
        _SPACES.pop(name, None)


class _MemWrite(PendingWrite):
    """Staging = a private buffer of the first ``limit`` bytes; seal = put-if-absent."""

    def __init__(self, store: "MemStore", key: ChunkKey, hashes: Sequence[int], parts: list):
        self._whole = b"".join(parts)
        super().__init__(key, hashes, len(self._whole), store.visibility)
        self.store = store
        self.staged = b""

    def _stage(self, limit: int) -> bool:
        self.staged = self._whole[:limit]
        return True

    def _seal_atomic(self) -> bool:
        return self.store._seal(self.key, self.staged, self.hashes)

    def _discard(self) -> None:
        self.staged = b""


class MemStore(KVStore):
    """Chunks in process memory under ``name`` (see module docstring)."""

    def __init__(self, name: str = "default", chunk_blocks: int = 1, event_sink: EventSink | None = None,
                 stale_timeout_s: float = DEFAULT_STALE_TIMEOUT_S, capacity_bytes: int = 0):
        super().__init__(chunk_blocks, event_sink, stale_timeout_s, capacity_bytes)
        self.name = name
        self.url = f"mem://{name}"
        self._sp = _space(name)

    # ---- primitives ---------------------------------------------------------------------
    def _seal(self, key: ChunkKey, value: bytes, hashes: list[int]) -> bool:
        sp = self._sp
        with sp.lock:
            if key in sp.chunks:
                return False
            sp.chunks[key] = (value, hashes)
            sp.bytes += len(value)
        return True

    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        ch = self._sp.chunks
        return [k in ch for k in keys]

    def _get_many(self, keys: list[ChunkKey]) -> list[object | None]:
        sp = self._sp
        out: list[object | None] = []
        with sp.lock:
            for k in keys:
                v = sp.chunks.get(k)
                if v is None:
                    out.append(None)
                    continue
                sp.chunks.move_to_end(k)  # LRU: a read refreshes recency
                out.append(v[0])
        return out

    def _put_many(self, items: list[tuple[ChunkKey, list]]) -> list[bool]:
        """Whole values in hand: each is joined once and sealed at once, put-if-absent under
        the space's lock (first sealer wins), as Redis's ``SET NX`` collapses WRITING and
        SEALED into one step; no staging buffer (:meth:`begin_write` keeps the staged state
        machine for writers that write part by part). :meth:`KVStore.put_blocks` announces."""
        sp = self._sp
        res = []
        with sp.lock:
            for key, parts in items:
                if key in sp.chunks:
                    res.append(False)
                    continue
                value = b"".join(parts)
                # a one-block chunk's header names exactly its key's hash (put_blocks built both)
                sp.chunks[key] = (value, [key[0]] if key[1] == 1 else header_hashes(parts[0]) or [key[0]])
                sp.bytes += len(value)
                res.append(True)
        if self.capacity_bytes and any(res):
            self.evict_to(self.capacity_bytes)
        return res

    def _invalidate(self, key: ChunkKey, trailer: bytes | None) -> bool:
        sp = self._sp
        with sp.lock:
            v = sp.chunks.get(key)
            if v is None or (trailer is not None and v[0][-8:] != trailer):
                return False
            del sp.chunks[key]
            sp.bytes -= len(v[0])
        return True

    def _delete_keys(self, keys: list[ChunkKey]) -> list[bool]:
        sp = self._sp
        out = []
        with sp.lock:
            for k in keys:
                v = sp.chunks.pop(k, None)
                if v is not None:
                    sp.bytes -= len(v[0])
                out.append(v is not None)
        return out

    def _scan(self) -> Iterable[tuple[ChunkKey, int]]:
        with self._sp.lock:
            return [(k, len(v[0])) for k, v in self._sp.chunks.items()]

    def begin_write(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray],
                    block_size: int | None = None) -> PendingWrite:
        if len(block_hashes) > self.chunk_blocks:
            raise ValueError("more blocks than chunk_blocks")
        hs = [int(h) for h in block_hashes]
        return _MemWrite(self, (hs[-1], len(hs)), hs, encode_parts(hs, blocks, block_size))

    def reclaim_stale(self, max_age_s: float | None = None) -> int:
        return 0  # staging buffers belong to their writer (module docstring)

    def evict_to(self, max_bytes: int) -> int:
        """Evict least-recently-used chunks until at most ``max_bytes`` remain; ``BlockRemoved``
        names every block of each evicted chunk. Returns chunks evicted."""
        sp = self._sp
        gone = []
        with sp.lock:
            while sp.bytes > max_bytes and sp.chunks:
                k, (v, hs) = sp.chunks.popitem(last=False)
                sp.bytes -= len(v)
                gone.append((k, hs))
        for k, hs in gone:
            self.visibility.evicted_chunk(k, hs)
        self._bump(evicted=len(gone))
        return len(gone)
