"""``file://DIR`` backend: one file per chunk in a shared directory (embedded default).

Typically ``DIR`` is under ``/dev/shm`` (tmpfs, shared by all processes of one host; no fsync
needed) or on a shared filesystem across hosts.

Layout: visible chunk ``DIR/<last_hash:016x>.<n>.kv``; staging files ``DIR/.tmp.<...>`` (same
directory, hence same filesystem). Protocol: ALLOCATED = a temp name is chosen; WRITING = bytes
go to the temp file; SEALED+VISIBLE = ``os.link(temp, final)``, which is atomic and fails with
``EEXIST`` if another writer sealed first (first sealer wins — ``rename`` would silently
overwrite); then the temp name is unlinked. A writer killed at any point leaves at most a temp
file, which no reader opens and :meth:`FileStore.reclaim_stale` deletes once older than
``stale_timeout_s`` (also run opportunistically by writers).

Capacity (``capacity_bytes > 0``): LRU by file mtime. A read ``utime``s the chunks it served
(mtime = last access; the file's content never changes after sealing, so mtime is free to
carry recency across processes — atime is unreliable under ``relatime``/``noatime``). After a
write, a writer whose running estimate of the directory size (last scan + its own writes)
exceeds the capacity — or whose last scan is older than ``evict_interval_s`` — rescans and
evicts oldest-first down to the capacity (:meth:`FileStore.evict_to`). Each eviction reads the
chunk's header first, so ``BlockRemoved`` names every block of the chunk; ``unlink`` decides
which of several concurrent evictors reports it. Other processes' writes are noticed at the
next rescan, so the directory may exceed the capacity by what others wrote within one
``evict_interval_s``.
"""
from __future__ import annotations

import os
import time
import uuid
from typing import Iterable, Sequence

import numpy as np

from cpd.store.base import DEFAULT_STALE_TIMEOUT_S, ChunkKey, EventSink, KVStore, PendingWrite, StoreUnavailable
from cpd.store.chunk_format import encode_parts, header_hashes, header_prefix_len

_TMP = ".tmp."
_EXT = ".kv"


def _name(key: ChunkKey) -> str:
    return f"{key[0]:016x}.{key[1]}{_EXT}"


def _parse(name: str) -> ChunkKey | None:
    if not name.endswith(_EXT) or name.startswith("."):
        return None
    h, _, n = name[:-len(_EXT)].partition(".")
    try:
        return int(h, 16), int(n)
    except ValueError:
        return None


def _plen(p) -> int:
    return len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes


class _FileWrite(PendingWrite):
    """Staging = a temp file in the store directory; seal = ``link(temp, final)`` (atomic, fails
    if another writer sealed first); the temp name is unlinked afterwards either way."""

    def __init__(self, store: "FileStore", key: ChunkKey, hashes: Sequence[int], parts: list):
        super().__init__(key, hashes, sum(_plen(p) for p in parts), store.visibility)
        self.store, self.parts = store, parts
        self.tmp = os.path.join(store.root, f"{_TMP}{_name(key)}.{os.getpid()}.{uuid.uuid4().hex[:12]}")

    def _stage(self, limit: int) -> bool:
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if self.written == 0 else 0)
        try:
            fd = os.open(self.tmp, flags, 0o644)
        except FileNotFoundError:
            if self.written == 0:
                raise self.store._unavailable(FileNotFoundError(self.store.root))
            return False  # staging file reclaimed (writer exceeded stale_timeout_s)
        except OSError as e:
            raise self.store._unavailable(e)
        try:
            with open(fd, "ab", buffering=0) as f:
                pos = 0
                for p in self.parts:
                    ln = _plen(p)
                    lo, hi = max(self.written - pos, 0), min(limit - pos, ln)
                    if hi > lo:
                        f.write(memoryview(p)[lo:hi])
                    pos += ln
        except OSError as e:
            raise self.store._unavailable(e)
        return True

    def _seal_atomic(self) -> bool:
        try:
            os.link(self.tmp, os.path.join(self.store.root, _name(self.key)))
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            self.store._check_root()
            return False  # staging file reclaimed: never visible
        except OSError as e:
            raise self.store._unavailable(e)
        finally:
            self._discard()

    def _discard(self) -> None:
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


class FileStore(KVStore):
    """Chunk files in directory ``root`` (created if missing; its later disappearance, or any
    I/O error other than a missing chunk, raises :class:`StoreUnavailable`)."""

    def __init__(self, root: str, chunk_blocks: int = 1, event_sink: EventSink | None = None,
                 stale_timeout_s: float = DEFAULT_STALE_TIMEOUT_S, capacity_bytes: int = 0,
                 evict_interval_s: float = 5.0):
        super().__init__(chunk_blocks, event_sink, stale_timeout_s, capacity_bytes)
        self.evict_interval_s = float(evict_interval_s)
        self._used_est = 0
        self._last_scan = 0.0
        self.root = os.path.abspath(root)
        self.url = f"file://{self.root}"
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"{self.url}: {e}") from e
        self._last_reclaim = 0.0

    def _unavailable(self, e: BaseException) -> StoreUnavailable:
        return StoreUnavailable(f"{self.url}: {e}")

    def _check_root(self) -> None:
        if not os.path.isdir(self.root):
            raise StoreUnavailable(f"{self.url}: directory missing")

    def _path(self, key: ChunkKey) -> str:
        return os.path.join(self.root, _name(key))

    def _per_key(self, keys: list[ChunkKey], op) -> list[bool]:
        """``op(path)`` per key: True if it succeeded, False if the file is missing; other
        OS errors mean the directory is unusable (:class:`StoreUnavailable`)."""
        self._check_root()
        out = []
        for k in keys:
            try:
                op(self._path(k))
                out.append(True)
            except FileNotFoundError:
                out.append(False)
            except OSError as e:
                raise self._unavailable(e)
        return out

    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]:
        return self._per_key(keys, os.stat)

    def _get_many(self, keys: list[ChunkKey]) -> list[object | None]:
        out: list[object | None] = []
        for k in keys:
            try:
                with open(self._path(k), "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    buf = np.empty(size, dtype=np.uint8)
                    got = f.readinto(buf.data)
                    out.append(buf if got == size else buf[:got])
                    if self.capacity_bytes:
                        try:
                            os.utime(f.fileno())  # LRU: mtime = last access
                        except OSError:
                            pass
            except FileNotFoundError:
                self._check_root()
                out.append(None)
            except OSError as e:
                raise self._unavailable(e)
        return out

    def _put_many(self, items: list[tuple[ChunkKey, list]]) -> list[bool]:
        self._check_root()
        now = time.monotonic()
        if now - self._last_reclaim > self.stale_timeout_s / 2:
            self._last_reclaim = now
            self.reclaim_stale()
        res = []
        for key, parts in items:
            if os.path.exists(self._path(key)):  # cheap early drop; link() decides for real
                res.append(False)
                continue
            w = _FileWrite(self, key, header_hashes(parts[0]) or [key[0]], parts)
            try:
                w.write(1.0)
                res.append(w.seal(announce=False))  # put_blocks announces, with parent and tokens
            except BaseException:
                w.abort()
                raise
            if res[-1]:
                self._used_est += w.total_bytes
        if self.capacity_bytes and any(res):
            self._maybe_evict()
        return res

    def _maybe_evict(self) -> None:
        now = time.monotonic()
        if self._used_est > self.capacity_bytes or now - self._last_scan > self.evict_interval_s:
            self.evict_to(self.capacity_bytes)

    def _invalidate(self, key: ChunkKey, trailer: bytes | None) -> bool:
        p = self._path(key)
        try:
            if trailer is not None:
                with open(p, "rb") as f:
                    f.seek(-8, os.SEEK_END)
                    if f.read(8) != trailer:
                        return False
            os.unlink(p)
            return True
        except FileNotFoundError:
            return False
        except OSError:
            return False

    def _delete_keys(self, keys: list[ChunkKey]) -> list[bool]:
        return self._per_key(keys, os.unlink)

    def _scan_stat(self) -> Iterable[tuple[ChunkKey, os.stat_result]]:
        """Visible chunks with their ``stat`` (files deleted meanwhile are skipped).
        Raises: StoreUnavailable."""
        self._check_root()
        try:
            with os.scandir(self.root) as it:
                for e in it:
                    k = _parse(e.name)
                    if k is None:
                        continue
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    yield k, st
        except OSError as e:
            raise self._unavailable(e)

    def _scan(self) -> Iterable[tuple[ChunkKey, int]]:
        for k, st in self._scan_stat():
            yield k, st.st_size

    def begin_write(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray],
                    block_size: int | None = None) -> PendingWrite:
        if len(block_hashes) > self.chunk_blocks:
            raise ValueError("more blocks than chunk_blocks")
        self._check_root()
        hs = [int(h) for h in block_hashes]
        return _FileWrite(self, (hs[-1], len(hs)), hs, encode_parts(hs, blocks, block_size))

    def reclaim_stale(self, max_age_s: float | None = None) -> int:
        age = self.stale_timeout_s if max_age_s is None else max_age_s
        cutoff = time.time() - age
        n = 0
        try:
            with os.scandir(self.root) as it:
                for e in it:
                    if not e.name.startswith(_TMP):
                        continue
                    try:
                        if e.stat().st_mtime <= cutoff:
                            os.unlink(e.path)
                            n += 1
                    except FileNotFoundError:
                        continue
        except FileNotFoundError:
            raise StoreUnavailable(f"{self.url}: directory missing")
        except OSError as e:
            raise self._unavailable(e)
        self._bump(reclaimed=n)
        return n

    def evict_to(self, max_bytes: int) -> int:
        """Delete least-recently-used chunks (oldest mtime; reads refresh it when a capacity is
        set) until visible data is at most ``max_bytes``; emits ``BlockRemoved`` naming every
        block of each evicted chunk. Returns chunks evicted. Raises: StoreUnavailable."""
        entries = []
        total = 0
        for k, st in self._scan_stat():
            entries.append((st.st_mtime_ns, k, st.st_size))
            total += st.st_size
        entries.sort()
        n = 0
        for _, k, size in entries:
            if total <= max_bytes:
                break
            total -= size
            p = self._path(k)
            hs = None
            try:
                with open(p, "rb") as f:
                    hs = header_hashes(f.read(header_prefix_len(k[1])))
                os.unlink(p)
            except FileNotFoundError:
                continue  # someone else evicted/deleted it (and reports it)
            except OSError as e:
                raise self._unavailable(e)
            n += 1
            self.visibility.evicted_chunk(k, hs or [])
        self._used_est = total
        self._last_scan = time.monotonic()
        self._bump(evicted=n)
        return n
