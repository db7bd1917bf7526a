"""The value format of one L3 chunk: header, payload, checksum trailer.

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
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import xxhash

from cpd.store.errors import CorruptValue

MAGIC = b"CPDK"
VERSION = 1
_HDR = struct.Struct("<4sHHIQH")
_U64 = struct.Struct("<Q")


def block_desc(block: np.ndarray) -> str:
    """``"<dtype.str>:<shape>"`` of one block, e.g. ``"<f4:2,2,16,4,8"``."""
    return _desc(block.dtype.str, block.shape)


@functools.lru_cache(maxsize=256)
def _desc(dtype_str: str, shape: tuple[int, ...]) -> str:
    return f"{dtype_str}:{','.join(str(d) for d in shape)}"


@functools.lru_cache(maxsize=256)
def _desc_bytes(dtype_str: str, shape: tuple[int, ...]) -> bytes:
    """:func:`block_desc` as the header's UTF-8 bytes (one per distinct dtype and shape)."""
    return _desc(dtype_str, shape).encode()


def parse_desc(desc: str) -> tuple[np.dtype, tuple[int, ...]]:
    dt, _, shp = desc.partition(":")
    shape = tuple(int(x) for x in shp.split(",")) if shp else ()
    return np.dtype(dt), shape


@functools.lru_cache(maxsize=256)
def _parsed_desc(desc: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """``(dtype, shape, bytes of one block)`` of a header's desc bytes (:func:`parse_desc`; a
    store holds a handful of distinct descs, and a read decodes one per block)."""
    dtype, shape = parse_desc(desc.decode())
    return dtype, shape, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def infer_block_size(block: np.ndarray) -> int:
    """Tokens per block from the engine layout ``[L, 2, block_size, H, D]``; 0 if not 5-D."""
    return int(block.shape[2]) if block.ndim == 5 else 0


def _as_bytes_view(a: np.ndarray) -> memoryview:
    return np.ascontiguousarray(a).data.cast("B")


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
    for b in blocks[1:]:
        if b.dtype != first.dtype or b.shape != first.shape:
            raise ValueError("all blocks of a chunk must share dtype and shape")
    bs = infer_block_size(first) if block_size is None else int(block_size)
    return _chunk_parts(_fixed_header(n, bs, first), block_hashes, [_as_bytes_view(b) for b in blocks])


def _fixed_header(n: int, block_size: int, first: np.ndarray) -> bytes:
    """The part of a chunk's header before its block hashes (``n`` blocks like ``first``)."""
    d = _desc_bytes(first.dtype.str, first.shape)
    return _HDR.pack(MAGIC, VERSION, n, block_size, first.nbytes, len(d)) + d


def _chunk_parts(fixed: bytes, block_hashes: Sequence[int], views: list[memoryview]) -> list[memoryview | bytes]:
    """``[header, block_0, ..., block_{n-1}, trailer]``: ``fixed`` + the hashes, the block
    views, the xxh3 checksum of all of it."""
    n = len(views)
    header = fixed + (_U64.pack(int(block_hashes[0])) if n == 1 else struct.pack(f"<{n}Q", *map(int, block_hashes)))
    hx = xxhash.xxh3_64(header)
    for v in views:
        hx.update(v)
    return [header, *views, _U64.pack(hx.intdigest())]


def encode_chunks(block_hashes: Sequence[int], blocks: Sequence[np.ndarray], ranges: Sequence[tuple[int, int]],
                  block_size: int | None = None) -> list[list[memoryview | bytes]]:
    """:func:`encode_parts` of the chunks ``blocks[s:e]`` for each ``(s, e)`` of ``ranges`` (the
    same buffers), in bulk: when every block shares the first's dtype and shape, the header's
    fixed part is built once per chunk size and each distinct block array is viewed once (a
    writer that stores the same array under many hashes, e.g. a simulator's prewarm, hashes
    and joins views of one buffer). Otherwise chunk by chunk (:func:`encode_parts`)."""
    if not ranges:
        return []
    first = blocks[0]
    dt, shape = first.dtype, first.shape
    if any(b is not first and (b.dtype != dt or b.shape != shape) for b in blocks):
        return [encode_parts(block_hashes[s:e], blocks[s:e], block_size) for s, e in ranges]
    bs = infer_block_size(first) if block_size is None else int(block_size)
    fixed: dict[int, bytes] = {}
    views: dict[int, memoryview] = {}  # id(block) -> its bytes (blocks holds every block alive)

    def view(b: np.ndarray) -> memoryview:
        v = views.get(id(b))
        if v is None:
            v = views[id(b)] = _as_bytes_view(b)
        return v

    out = []
    for s, e in ranges:
        n = e - s
        if n <= 0 or n > 0xFFFF:
            raise ValueError(f"a chunk needs 1..65535 blocks (got {n})")
        pre = fixed.get(n)
        if pre is None:
            pre = fixed[n] = _fixed_header(n, bs, first)
        out.append(_chunk_parts(pre, block_hashes[s:e], [view(b) for b in blocks[s:e]]))
    return out


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
        dtype, shape, nbytes = _parsed_desc(bytes(mv[_HDR.size:_HDR.size + dlen]))
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise CorruptValue(f"bad desc: {e}") from None
    if nbytes != bnb:
        raise CorruptValue("desc does not match block size")
    hashes = ([_U64.unpack_from(mv, _HDR.size + dlen)[0]] if n == 1
              else list(struct.unpack_from(f"<{n}Q", mv, _HDR.size + dlen)))
    if expect_last is not None and hashes[-1] != expect_last:
        raise CorruptValue("key/header hash mismatch")
    if expect_n is not None and n != expect_n:
        raise CorruptValue("key/header size mismatch")
    # one ndarray over the value's bytes per block (a simulated L3 load decodes one per block)
    blocks = [np.ndarray(shape, dtype, mv, hdr_len + i * bnb) for i in range(n)]
    return DecodedChunk(hashes, bs, blocks, bytes(mv[total - 8:]))


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


def readable_header_hashes(key: tuple[int, int], raw) -> list[int]:
    """Every block hash of a (possibly corrupt) value whose header still names ``key``'s
    chunk; just the key's last hash when the header is unreadable or names another chunk."""
    mv = memoryview(raw).cast("B")
    try:
        magic, _, n, _, _, dlen = _HDR.unpack_from(mv, 0)
        if magic == MAGIC and n == key[1]:
            hh = list(struct.unpack_from(f"<{n}Q", mv, _HDR.size + dlen))
            if hh[-1] == key[0]:
                return hh
    except struct.error:
        pass
    return [key[0]]
