"""The L3 KV store interface, value wire format and visibility protocol (DESIGN §4).

Keys and chunks
---------------
A value ("chunk") holds ``n`` consecutive full blocks of one prefix chain, ``1 <= n <=
chunk_blocks``. It is keyed by ``(last_block_hash, n)``: because block hashes are chained
(``cpd.kv.block_hash``), the last hash of a chunk already identifies every block before it,
so no second index is needed. Chunking amortises the per-request overhead of the store
(one key, one round trip, one checksum per ``n`` blocks) while per-block addressing keeps
working: :meth:`KVStore.lookup_prefix` probes every candidate key ``(h_j, n)`` for
``n in 1..chunk_blocks`` in one batch (one pipelined round trip for Redis) and takes the
longest run of leading blocks covered by visible chunks. A chunk that starts before the
first requested block still counts (its tail is used), so a chain saved in pieces (e.g. the
engine saving blocks 0..9, later 10..19) is found regardless of where chunks begin.
The price of chunking is hit granularity: a chunk can only be named by its last hash, so a
request that shares a stored chain up to the middle of a chunk hits only up to the last whole
chunk it contains (as with any chunk-keyed KV store); ``chunk_blocks=1`` (the default) gives
block-granular hits, larger values trade that for fewer, larger values.
``chunk_blocks`` is part of the store URL and must be the same for all processes sharing a
store (a reader only probes sizes up to its own ``chunk_blocks``).

Wire format of a value (all integers little-endian)::

    header  = magic b"CPDK" | u16 version=1 | u16 n_blocks | u32 block_size (tokens, 0=unknown)
              | u64 block_nbytes | u16 len(desc) | desc (UTF-8 "<numpy dtype.str>:<d0>,<d1>,...",
              the shape of ONE block) | n_blocks x u64 block hash
    payload = n_blocks x block_nbytes bytes (each block C-contiguous)
    trailer = u64 xxh3_64(header + payload)

Readers verify magic, version, sizes, the checksum and that the header's hashes are the
requested ones; any mismatch makes the entry invalid: it is deleted (only if it is still the
same value), a ``BlockRemoved(medium="L3")`` is emitted, and the read reports a miss. Corrupt
data is never returned.

Visibility protocol (ALLOCATED -> WRITING -> SEALED -> VISIBLE -> EVICTED): a
:class:`PendingWrite` is ALLOCATED by :meth:`KVStore.begin_write`, WRITING while its bytes go
to a private staging location (temp file / staging key with a TTL), and SEALED+VISIBLE in one
atomic step (``link()`` / ``RENAMENX``), first sealer wins. A writer that dies leaves only
staging data that no reader looks at and that is reclaimed after ``stale_timeout_s``.
"""
from __future__ import annotations

import struct
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import xxhash

from cpd.kv.events import MEDIUM_L3, BlockRemoved, BlockStored, KVCacheEvent

MAGIC = b"CPDK"
VERSION = 1
_HDR = struct.Struct("<4sHHIQH")
_U64 = struct.Struct("<Q")
DEFAULT_STALE_TIMEOUT_S = 30.0

ChunkKey = tuple[int, int]
"""``(last_block_hash, n_blocks)`` — the key of one chunk."""


class StoreUnavailable(Exception):
    """The store cannot be reached (connection refused/reset, timeout, directory gone).
    The single error type every store operation raises for store faults; callers treat it
    as a miss (DESIGN §4 'Fallbacks')."""


class StoreTimeout(StoreUnavailable):
    """The store did not answer within the configured timeout (a slow or stalled store)."""


class CorruptValue(Exception):
    """A stored value failed validation (internal; stores turn it into a miss)."""


@dataclass
class StoreStats:
    """Counters of one store client plus what the store currently holds.

    ``num_chunks``/``num_blocks``/``bytes`` describe VISIBLE data in the whole store
    (``bytes`` = stored value sizes including headers); the rest count this client's calls."""

    num_chunks: int = 0
    num_blocks: int = 0
    bytes: int = 0
    puts: int = 0
    blocks_written: int = 0
    blocks_dropped_existing: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    reclaimed: int = 0
    evicted: int = 0
    extra: dict = field(default_factory=dict)


def block_desc(block: np.ndarray) -> str:
    """``"<dtype.str>:<shape>"`` of one block, e.g. ``"<f4:2,2,16,4,8"``."""
    return f"{block.dtype.str}:{','.join(str(d) for d in block.shape)}"


def parse_desc(desc: str) -> tuple[np.dtype, tuple[int, ...]]:
    dt, _, shp = desc.partition(":")
    shape = tuple(int(x) for x in shp.split(",")) if shp else ()
    return np.dtype(dt), shape


def infer_block_size(block: np.ndarray) -> int:
    """Tokens per block from the engine layout ``[L, 2, block_size, H, D]``; 0 if not 5-D."""
    return int(block.shape[2]) if block.ndim == 5 else 0


def _as_bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def encode_parts(block_hashes: Sequence[int], blocks: Sequence[np.ndarray],
                 block_size: int | None = None) -> list[memoryview | bytes]:
    """Encode one chunk as ``[header, block_0, ..., block_{n-1}, trailer]`` buffers (no copy
    of the payload). All blocks must share dtype and shape.

    Raises:
        ValueError: empty chunk, length mismatch, or blocks of differing dtype/shape.
    """
    n = len(block_hashes)
    if n == 0 or n != len(blocks):
        raise ValueError(f"need as many blocks as hashes (got {n} hashes, {len(blocks)} blocks)")
    if n > 0xFFFF:
        raise ValueError("too many blocks in one chunk")
    first = blocks[0]
    desc = block_desc(first)
    for b in blocks[1:]:
        if b.dtype != first.dtype or b.shape != first.shape:
            raise ValueError("all blocks of a chunk must share dtype and shape")
    bs = infer_block_size(first) if block_size is None else int(block_size)
    d = desc.encode()
    header = _HDR.pack(MAGIC, VERSION, n, bs, first.nbytes, len(d)) + d + b"".join(
        _U64.pack(int(h)) for h in block_hashes)
    views = [_as_bytes_view(b) for b in blocks]
    hx = xxhash.xxh3_64()
    hx.update(header)
    for v in views:
        hx.update(v)
    return [header, *views, _U64.pack(hx.intdigest())]


def encode_value(block_hashes: Sequence[int], blocks: Sequence[np.ndarray],
                 block_size: int | None = None) -> bytearray:
    """Encode one chunk into a single buffer (one copy of the payload)."""
    parts = encode_parts(block_hashes, blocks, block_size)
    out = bytearray(sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts))
    pos = 0
    for p in parts:
        ln = len(p) if isinstance(p, bytes) else p.nbytes
        out[pos:pos + ln] = p
        pos += ln
    return out


@dataclass
class DecodedChunk:
    block_hashes: list[int]
    block_size: int
    blocks: list[np.ndarray]
    trailer: bytes


def decode_value(buf, expect_last: int | None = None, expect_n: int | None = None) -> DecodedChunk:
    """Validate and decode one value. Returned blocks are views into ``buf`` (read-only when
    ``buf`` is ``bytes``).

    Raises:
        CorruptValue: bad magic/version/length, checksum mismatch, or the header's last hash /
            block count differ from ``expect_last`` / ``expect_n``.
    """
    mv = memoryview(buf).cast("B")
    total = mv.nbytes
    if total < _HDR.size + 8:
        raise CorruptValue("short value")
    magic, ver, n, bs, bnb, dlen = _HDR.unpack_from(mv, 0)
    if magic != MAGIC or ver != VERSION:
        raise CorruptValue("bad magic/version")
    hdr_len = _HDR.size + dlen + 8 * n
    if n == 0 or total != hdr_len + n * bnb + 8:
        raise CorruptValue("bad length")
    want = _U64.unpack_from(mv, total - 8)[0]
    if xxhash.xxh3_64_intdigest(mv[:total - 8]) != want:
        raise CorruptValue("checksum mismatch")
    try:
        dtype, shape = parse_desc(bytes(mv[_HDR.size:_HDR.size + dlen]).decode())
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise CorruptValue(f"bad desc: {e}") from None
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != bnb:
        raise CorruptValue("desc does not match block size")
    hashes = list(struct.unpack_from(f"<{n}Q", mv, _HDR.size + dlen))
    if expect_last is not None and hashes[-1] != expect_last:
        raise CorruptValue("key/header hash mismatch")
    if expect_n is not None and n != expect_n:
        raise CorruptValue("key/header size mismatch")
    arr = np.frombuffer(buf, dtype=np.uint8)
    blocks = [arr[hdr_len + i * bnb: hdr_len + (i + 1) * bnb].view(dtype).reshape(shape) for i in range(n)]
    return DecodedChunk(hashes, bs, blocks, bytes(mv[total - 8:]))


def split_chunks(n_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of consecutive chunks of at most ``chunk_blocks`` blocks."""
    return [(s, min(s + chunk_blocks, n_blocks)) for s in range(0, n_blocks, chunk_blocks)]


def cover(present: dict[ChunkKey, bool], block_hashes: Sequence[int], chunk_blocks: int
          ) -> tuple[int, list[tuple[int, int, ChunkKey]]]:
    """Longest run of leading blocks covered by present chunks, and a minimal chain of chunks
    covering it as ``(start_pos, end_pos_inclusive, key)``; ``start_pos`` may be negative (the
    chunk begins before the first requested block)."""
    intervals = []
    for j, h in enumerate(block_hashes):
        for n in range(1, chunk_blocks + 1):
            if present.get((h, n)):
                intervals.append((j - n + 1, j, (h, n)))
    intervals.sort()
    covered, chain, i = 0, [], 0
    while True:
        cand = None
        while i < len(intervals) and intervals[i][0] <= covered:
            if intervals[i][1] + 1 > covered and (cand is None or intervals[i][1] > cand[1]):
                cand = intervals[i]
            i += 1
        if cand is None:
            break
        chain.append(cand)
        covered = cand[1] + 1
    return covered, chain


def header_hashes(buf) -> list[int] | None:
    """Block hashes named by a value's header (``buf`` may be just a prefix of the value that
    holds the whole header); None if the header is unreadable."""
    mv = memoryview(buf).cast("B")
    try:
        magic, ver, n, _, _, dlen = _HDR.unpack_from(mv, 0)
        if magic != MAGIC or ver != VERSION or n == 0:
            return None
        return list(struct.unpack_from(f"<{n}Q", mv, _HDR.size + dlen))
    except struct.error:
        return None


def header_prefix_len(n_blocks: int) -> int:
    """Bytes that always contain the header of an ``n_blocks`` chunk (desc is short)."""
    return _HDR.size + 1024 + 8 * n_blocks


def candidate_keys(block_hashes: Sequence[int], chunk_blocks: int) -> list[ChunkKey]:
    return [(int(h), n) for h in block_hashes for n in range(1, chunk_blocks + 1)]


EventSink = Callable[[KVCacheEvent], None]


@dataclass
class Observation:
    """What one store call saw, for keeping an index of the store honest (issue 7 §6).

    Every candidate key ``(h, n)`` with ``h`` in ``block_hashes`` and ``1 <= n <= chunk_blocks``
    was checked at one moment; ``present`` are the ones found visible (and not found bad on
    read), ``gone`` the ones a read found missing or corrupt (corrupt ones were deleted). So for
    each ``h`` in ``block_hashes`` the chunks ending at ``h`` are exactly those in ``present``."""

    block_hashes: list[int]
    present: list[ChunkKey]
    gone: list[ChunkKey] = field(default_factory=list)


ObservationSink = Callable[[Observation], None]


class PendingWrite(ABC):
    """One chunk on its way into the store (ALLOCATED until :meth:`write`, then WRITING).

    ``write(fraction)`` stages the first ``fraction`` of the value's bytes (``1.0`` = all;
    partial writes exist to model a writer that dies mid-write); ``seal()`` makes a fully
    written value SEALED+VISIBLE atomically and returns ``True`` if this writer won (first
    sealer wins; a loser's data is discarded); ``abort()`` discards staging data. A write
    never sealed is never visible."""

    key: ChunkKey

    @abstractmethod
    def write(self, fraction: float = 1.0) -> None: ...

    @abstractmethod
    def seal(self) -> bool: ...

    @abstractmethod
    def abort(self) -> None: ...


class KVStore(ABC):
    """A shared L3 KV store (one client). Thread-safe for concurrent calls.

    Args (common to all backends):
        chunk_blocks: max blocks per value (>= 1); see the module docstring.
        event_sink: receives ``BlockStored``/``BlockRemoved`` (``medium="L3"``) events.
        stale_timeout_s: age after which abandoned staging data is reclaimed.
        capacity_bytes: if > 0, visible data is kept at or below this many bytes (value sizes
            incl. headers) by evicting least-recently-used chunks after writes; every eviction
            publishes ``BlockRemoved(medium="L3")`` naming all blocks of the chunk.

    Every method raises :class:`StoreUnavailable` (and nothing else) on store faults.
    """

    url: str = ""

    def __init__(self, chunk_blocks: int = 1, event_sink: EventSink | None = None,
                 stale_timeout_s: float = DEFAULT_STALE_TIMEOUT_S, capacity_bytes: int = 0):
        if chunk_blocks < 1:
            raise ValueError("chunk_blocks must be >= 1")
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = int(capacity_bytes)
        self.chunk_blocks = int(chunk_blocks)
        self.event_sink = event_sink
        self.observation_sink: ObservationSink | None = None
        self.stale_timeout_s = float(stale_timeout_s)
        self._lock = threading.Lock()
        self._st = StoreStats()

    # ---- backend primitives -------------------------------------------------------------
    @abstractmethod
    def _exists_many(self, keys: list[ChunkKey]) -> list[bool]: ...

    @abstractmethod
    def _get_many(self, keys: list[ChunkKey]) -> list[object | None]:
        """Raw values (bytes-like) or None if absent."""

    @abstractmethod
    def _put_many(self, items: list[tuple[ChunkKey, list]]) -> list[bool]:
        """Write+seal each value (parts as from :func:`encode_parts`) atomically, first wins.
        Returns, per item, whether this call made it visible."""

    @abstractmethod
    def _invalidate(self, key: ChunkKey, trailer: bytes | None) -> bool:
        """Delete ``key`` if its value still ends with ``trailer`` (any value if None)."""

    @abstractmethod
    def _delete_keys(self, keys: list[ChunkKey]) -> list[bool]: ...

    @abstractmethod
    def _scan(self) -> Iterable[tuple[ChunkKey, int]]:
        """All visible keys with their value sizes (bytes)."""

    @abstractmethod
    def begin_write(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray],
                    block_size: int | None = None) -> PendingWrite:
        """Allocate a write of ONE chunk (``len(block_hashes) <= chunk_blocks``)."""

    @abstractmethod
    def reclaim_stale(self, max_age_s: float | None = None) -> int:
        """Remove staging data older than ``max_age_s`` (default ``stale_timeout_s``);
        returns how many entries were removed."""

    def close(self) -> None:
        """Release connections/handles (idempotent)."""

    def list_visible(self) -> list[ChunkKey]:
        """Keys ``(last_block_hash, n_blocks)`` of every VISIBLE chunk, as of one scan (a
        snapshot from which an index of the store is rebuilt; O(chunks)).
        Raises: StoreUnavailable."""
        return [k for k, _ in self._scan()]

    def evict_to(self, max_bytes: int) -> int:
        """Evict least-recently-used visible chunks until at most ``max_bytes`` remain
        (emits ``BlockRemoved`` for every block of each evicted chunk). Returns chunks evicted.
        Raises: StoreUnavailable."""
        raise NotImplementedError

    # ---- events -------------------------------------------------------------------------
    def _emit(self, ev: KVCacheEvent) -> None:
        if self.event_sink is not None:
            try:
                self.event_sink(ev)
            except Exception:  # a faulty sink must never break the data path
                pass

    def _emit_removed(self, hashes: list[int]) -> None:
        """``BlockRemoved`` for ONE chunk: its block hashes in chain order (or just its last
        hash when the others are unknown). One event per chunk, so that a reader keyed by
        chunk (``cpd.router.index``) knows exactly which chunk went."""
        if hashes:
            self._emit(BlockRemoved(block_hashes=[int(h) for h in hashes], medium=MEDIUM_L3))

    def _emit_stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
                     block_size: int) -> None:
        """``BlockStored`` for ONE visible chunk (hashes in chain order)."""
        self._emit(BlockStored(block_hashes=[int(h) for h in hashes],
                               parent_block_hash=None if parent is None else int(parent),
                               token_ids=[] if token_ids is None else [int(t) for t in token_ids],
                               block_size=int(block_size), medium=MEDIUM_L3))

    def _announce_existing(self, keys: Iterable[ChunkKey], hs: list[int], parent_block_hash: int | None,
                           token_ids: Sequence[int] | None, block_size: int) -> None:
        """Re-publish ``BlockStored`` for visible chunks lying wholly inside ``hs`` (a chain from
        its first block), so that an index that lost them (router restart, lost events)
        relearns them from the next writer that meets them."""
        pos_of = {h: i for i, h in enumerate(hs)}
        for last, n in sorted(set(keys), key=lambda k: pos_of.get(k[0], -1)):
            j = pos_of.get(last)
            if j is None or j - n + 1 < 0:
                continue
            s = j - n + 1
            parent = parent_block_hash if s == 0 else hs[s - 1]
            toks = None if token_ids is None or not block_size else token_ids[s * block_size:(j + 1) * block_size]
            self._emit_stored(hs[s:j + 1], parent, toks, block_size)

    def _observe(self, obs: Observation) -> None:
        if self.observation_sink is not None:
            try:
                self.observation_sink(obs)
            except Exception:  # never break the data path
                pass

    def _bump(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self._st, k, getattr(self._st, k) + v)

    # ---- public API ---------------------------------------------------------------------
    def put_blocks(self, block_hashes: Sequence[int], blocks: Sequence[np.ndarray], *,
                   parent_block_hash: int | None = None, token_ids: Sequence[int] | None = None,
                   block_size: int | None = None, skip_existing: bool = True) -> int:
        """Store consecutive blocks of one chain, cut into chunks of ``chunk_blocks``.

        Args:
            block_hashes: ``n`` chained block hashes.
            blocks: ``n`` arrays, same dtype/shape (engine layout
                ``[layers, 2, block_size, kv_heads, head_dim]``; any shape is accepted).
            parent_block_hash, token_ids: only for the ``BlockStored`` event (token ids flat,
                ``n * block_size`` of them, or None).
            block_size: tokens per block for the header/event (default: ``shape[2]`` of a 5-D block).
            skip_existing: first probe (one batched round trip) and skip chunks whose blocks
                are all visible already.
        Returns:
            Number of blocks this call made visible (blocks whose chunk already existed —
            another writer sealed first — are dropped and not counted).
        Raises:
            StoreUnavailable; ValueError on malformed input.
        """
        n = len(block_hashes)
        if n != len(blocks):
            raise ValueError("len(block_hashes) != len(blocks)")
        if n == 0:
            return 0
        bs = infer_block_size(blocks[0]) if block_size is None else int(block_size)
        ranges = split_chunks(n, self.chunk_blocks)
        hs_all = [int(h) for h in block_hashes]
        if skip_existing:
            ranges = self._skip_existing(hs_all, ranges, parent_block_hash, token_ids, bs)
        items = []
        for s, e in ranges:
            items.append(((hs_all[e - 1], e - s), encode_parts(hs_all[s:e], blocks[s:e], bs)))
        won = self._put_many(items)
        stored = 0
        lost = []
        for (s, e), ok in zip(ranges, won):
            if not ok:  # another writer sealed this very chunk first: it is visible, re-announce it
                self._bump(blocks_dropped_existing=e - s)
                lost.append((hs_all[e - 1], e - s))
                continue
            stored += e - s
            parent = parent_block_hash if s == 0 else hs_all[s - 1]
            toks = None if token_ids is None or bs == 0 else token_ids[s * bs:e * bs]
            self._emit_stored(hs_all[s:e], parent, toks, bs)
        self._announce_existing(lost, hs_all, parent_block_hash, token_ids, bs)
        self._bump(puts=1, blocks_written=stored)
        return stored

    def _skip_existing(self, hs: list[int], ranges: list[tuple[int, int]], parent_block_hash: int | None,
                       token_ids: Sequence[int] | None, bs: int) -> list[tuple[int, int]]:
        """One batched probe; chunks whose blocks are all visible already are not rewritten,
        and the visible chunks found are re-announced (``BlockStored``)."""
        keys = candidate_keys(hs, self.chunk_blocks)
        present = [k for k, there in zip(keys, self._exists_many(keys)) if there]
        covered = [False] * len(hs)
        pos_of = {h: i for i, h in enumerate(hs)}
        for last, m in present:
            j = pos_of[last]
            for p in range(max(0, j - m + 1), j + 1):
                covered[p] = True
        kept = [(s, e) for s, e in ranges if not all(covered[s:e])]
        self._bump(blocks_dropped_existing=sum(e - s for s, e in ranges if (s, e) not in kept))
        self._announce_existing(present, hs, parent_block_hash, token_ids, bs)
        return kept

    def lookup_prefix(self, block_hashes: Sequence[int], *, announce: bool = False,
                      parent_block_hash: int | None = None, token_ids: Sequence[int] | None = None,
                      block_size: int = 0) -> int:
        """Number of leading blocks of ``block_hashes`` held VISIBLY (one batched probe).

        With ``announce`` (a writer about to skip what exists; ``block_hashes`` then start a
        chain, ``parent_block_hash``/``token_ids``/``block_size`` describe them as for
        :meth:`put_blocks`), the visible chunks covering the leading blocks are re-announced
        with ``BlockStored``. Raises: StoreUnavailable."""
        if not block_hashes:
            return 0
        hs = [int(h) for h in block_hashes]
        keys = candidate_keys(hs, self.chunk_blocks)
        present = dict(zip(keys, self._exists_many(keys)))
        self._observe(Observation(hs, [k for k, there in present.items() if there]))
        covered, chain = cover(present, hs, self.chunk_blocks)
        if announce:
            self._announce_existing([c[2] for c in chain], hs, parent_block_hash, token_ids, block_size)
        return covered

    def contains(self, block_hash: int) -> bool:
        """Whether a visible chunk ends at ``block_hash``. Raises: StoreUnavailable."""
        return self.lookup_prefix([block_hash]) == 1

    def read_blocks(self, block_hashes: Sequence[int]) -> tuple[list[np.ndarray] | None, str]:
        """Like :meth:`get_blocks` but also says why: ``(blocks, "ok")``, ``(None, "miss")``
        or ``(None, "corrupt")`` (a corrupt entry was invalidated). Reports an
        :class:`Observation` naming exactly the chunks found present and those found missing
        or corrupt. Raises: StoreUnavailable."""
        self._bump(gets=1)
        hs = [int(h) for h in block_hashes]
        if not hs:
            return [], "ok"
        if self.chunk_blocks == 1:
            # one key per block: no probe needed, fetch everything in one round trip
            chain = [(j, j, (h, 1)) for j, h in enumerate(hs)]
            present = {c[2]: True for c in chain}
        else:
            keys = candidate_keys(hs, self.chunk_blocks)
            present = dict(zip(keys, self._exists_many(keys)))
            covered, chain = cover(present, hs, self.chunk_blocks)
            if covered < len(hs):
                self._observe(Observation(hs, [k for k, there in present.items() if there]))
                self._bump(misses=1)
                return None, "miss"
        out, reason, gone = self._read_chain(hs, chain)
        self._observe(Observation(hs, [k for k, there in present.items() if there and k not in gone], gone))
        if reason != "ok":
            self._bump(misses=1)
            return None, reason
        self._bump(hits=1)
        return out[:len(hs)], "ok"

    def _read_chain(self, hs: list[int], chain: list[tuple[int, int, ChunkKey]]
                    ) -> tuple[list[np.ndarray], str, list[ChunkKey]]:
        """Fetch and verify a chain of chunks: ``(blocks, reason, keys missing or corrupt)``."""
        raws = self._get_many([c[2] for c in chain])
        out: list[np.ndarray] = []
        gone: list[ChunkKey] = []
        pos = 0
        reason = "ok"
        for (start, end, key), raw in zip(chain, raws):
            if raw is None:
                reason = "miss" if reason == "ok" else reason
                gone.append(key)
                continue
            try:
                ch = decode_value(raw, expect_last=key[0], expect_n=key[1])
                # chained hashes: the overlapping part must match what was asked for
                for p in range(max(start, 0), end + 1):
                    if ch.block_hashes[p - start] != hs[p]:
                        raise CorruptValue("chain mismatch")
            except CorruptValue:
                self._handle_corrupt(key, raw)
                reason = "corrupt"
                gone.append(key)
                continue
            if reason == "ok":
                out.extend(ch.blocks[pos - start:])
                pos = end + 1
        return out, reason, gone

    def get_blocks(self, block_hashes: Sequence[int]) -> list[np.ndarray] | None:
        """Read blocks (checksums verified).

        Returns:
            One array per hash (dtype/shape as written; may be read-only views of one buffer),
            or None if any block is missing or was corrupt (corrupt entries are invalidated
            and reported with ``BlockRemoved``).
        Raises: StoreUnavailable."""
        return self.read_blocks(block_hashes)[0]

    def _handle_corrupt(self, key: ChunkKey, raw) -> None:
        self._bump(corrupt=1)
        mv = memoryview(raw).cast("B")
        trailer = bytes(mv[-8:]) if mv.nbytes >= 8 else None
        hashes = [key[0]]
        try:  # best effort: name every block of the chunk if the header is readable
            magic, ver, n, _, _, dlen = _HDR.unpack_from(mv, 0)
            if magic == MAGIC and n == key[1]:
                hh = list(struct.unpack_from(f"<{n}Q", mv, _HDR.size + dlen))
                if hh[-1] == key[0]:
                    hashes = hh
        except struct.error:
            pass
        if self._invalidate(key, trailer):
            self._emit_removed(hashes)

    def delete(self, block_hashes: Sequence[int]) -> int:
        """Delete every chunk ending at one of ``block_hashes``; emits one ``BlockRemoved`` per
        removed chunk, naming its blocks in chain order as far as ``block_hashes`` (taken as
        a chain) contains them, else just its last hash. Returns chunks removed.
        Raises: StoreUnavailable."""
        hs = [int(h) for h in block_hashes]
        keys = candidate_keys(hs, self.chunk_blocks)
        if not keys:
            return 0
        gone = self._delete_keys(keys)
        pos_of = {h: i for i, h in enumerate(hs)}
        for (last, n), g in zip(keys, gone):
            if g:
                j = pos_of[last]
                self._emit_removed(hs[j - n + 1:j + 1] if j - n + 1 >= 0 else [last])
        return sum(gone)

    def clear(self) -> int:
        """Delete every visible chunk (and stale staging data); emits one ``BlockRemoved`` per
        chunk (its last hash). Returns chunks removed. Raises: StoreUnavailable."""
        keys = self.list_visible()
        gone = self._delete_keys(keys) if keys else []
        for k, g in zip(keys, gone):
            if g:
                self._emit_removed([k[0]])
        self.reclaim_stale(0.0)
        return sum(gone)

    def stats(self) -> StoreStats:
        """Snapshot of counters and current contents (scans the store: O(entries)).
        Raises: StoreUnavailable."""
        nc = nb = by = 0
        for (_, n), size in self._scan():
            nc += 1
            nb += n
            by += size
        with self._lock:
            s = StoreStats(**{**self._st.__dict__, "extra": dict(self._st.extra)})
        s.num_chunks, s.num_blocks, s.bytes = nc, nb, by
        return s
