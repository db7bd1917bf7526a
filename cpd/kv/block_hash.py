"""Chained, namespaced block hashes (docs/architecture.md) — the one implementation used by
router, workers, store and simulator.

Definition (pinned by test vectors in ``tests/unit/test_block_hash.py``)::

    root            = H(b"cpd-ns-v1" + canonical_json(namespace))
    h_{-1}          = root
    h_i             = H(u64be(h_{i-1}) + u32le(tokens_i) + extra_keys_i)
    H(x)            = first 8 bytes of SHA-256(x), read big-endian -> int in [0, 2**64)

Only *full* blocks (exactly ``block_size`` tokens) are hashed. Python's ``hash()``
and pickle are never used, so digests are identical across processes, machines
and Python versions. The scheme follows vLLM's prefix-caching design
(``vllm/v1/core/kv_cache_utils.py``: parent hash + block tokens + extra keys),
with SHA-256 over canonical bytes instead of pickle.

Speed (issue 13): the tokens are turned into one contiguous ``u32le`` buffer and the chain
runs over it. Where the optional C extension ``cpd/kv/_chain_sha256.c`` is built (by ``pip
install``, given a C compiler and the OpenSSL headers) the packing and the whole chain are
one C call each over OpenSSL's SHA-256 (≈ 0.14 µs per 16-token block with SHA-NI), and a
prompt that continues one hashed recently (a session's next turn) hashes only the blocks past
the cached prefix (:class:`_PrefixCache`: bounded, keyed by parent, verified byte for byte).
Otherwise each block costs one ``hashlib.sha256`` call (≈ 0.85 µs), and runs of blocks
already hashed after the same parent (a session's growing prompt) are reused from a bounded
LRU keyed by their exact bytes. Both paths give the same bytes. The definition above is unchanged (the pinned vectors still hold). SHA-256 stays the
primitive because the namespace is a tenant boundary: a constructible collision would let
one tenant's blocks stand for another's. The 64-bit truncation keeps second preimages (what
reaching a victim's block needs) at ~2**64 work; widening it would change every store key and
event, and is not done here.
"""
from __future__ import annotations

import array
import hashlib
import json
import struct
import sys
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

HASH_VERSION = b"cpd-ns-v1"


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV non-interchangeable (docs/architecture.md 'namespace').

    Two requests whose namespaces differ in any field never share a block.
    """

    model_id: str
    weights_digest: str
    tokenizer_digest: str
    block_size: int = 16
    kv_dtype: str = "float32"
    kv_layout: str = "paged-lbhd-v1"
    adapter_id: str = ""
    cache_salt: str = ""

    def with_salt(self, cache_salt: str | None) -> "Namespace":
        """Return a copy with the tenant ``cache_salt`` (``None`` keeps it)."""
        if cache_salt is None or cache_salt == self.cache_salt:
            return self
        d = asdict(self)
        d["cache_salt"] = cache_salt
        return Namespace(**d)

    def canonical_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces, UTF-8) of all fields."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def root_hash(self) -> int:
        """``h_{-1}``: the hash every chain of this namespace starts from."""
        return _h(HASH_VERSION + self.canonical_bytes())


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def hash_block(parent_hash: int, block_token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
    """Hash one full block given its parent's hash.

    Args:
        parent_hash: ``h_{i-1}`` (the namespace root for the first block), in [0, 2**64).
        block_token_ids: the block's token ids (length ``block_size``), each in [0, 2**32).
        extra_keys: canonical bytes of per-block extra keys (e.g. multimodal hashes); usually empty.
    Returns:
        ``h_i`` as an int in [0, 2**64).
    """
    toks = np.asarray(block_token_ids, dtype="<u4").tobytes()
    return _h(struct.pack(">Q", parent_hash) + toks + extra_keys)


def hash_blocks(token_ids: Sequence[int], namespace: Namespace, parent_hash: int | None = None) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``.

    Computed over the tokens' contiguous ``u32le`` bytes, one SHA-256 call per block: in C
    when the extension is built, where a prompt continuing a recently hashed one (a session's
    prompt that grows) takes that one's digests up to its last multiple of
    :data:`CHECKPOINT_BLOCKS` blocks from :class:`_PrefixCache`; else in Python, where runs of
    :data:`GROUP_BLOCKS` blocks already hashed after the same parent come from a bounded LRU.
    Both caches compare the exact bytes (parent hash + tokens), so a hit is exact, never a
    hash collision.

    Args:
        token_ids: prompt token ids, length n (a list, or any integer array).
        namespace: the KV namespace; its ``block_size`` sets the block length.
        parent_hash: start the chain from this hash instead of the namespace root
            (to extend an already-hashed prefix).
    Returns:
        ``n // block_size`` hashes; the trailing partial block is never hashed.
    Raises:
        ValueError: a token id outside ``[0, 2**32)``.
    """
    return hash_blocks_u32le(_u32le_bytes(token_ids), namespace, parent_hash)


def hash_blocks_u32le(data: bytes | memoryview, namespace: Namespace, parent_hash: int | None = None) -> list[int]:
    """:func:`hash_blocks` of token ids already laid out as contiguous little-endian u32
    (``len(data) // 4`` ids, e.g. an engine's validated prompt): the same hashes, without
    converting the ids again.

    Args:
        data: bytes-like, ``4 * n`` bytes (a byte-format buffer, e.g. bytes or a memoryview of them).
        namespace, parent_hash: as for :func:`hash_blocks`.
    Returns:
        ``n // block_size`` hashes.
    """
    step = 4 * namespace.block_size
    n = len(data) // step  # len in bytes: ``data`` is byte-format
    if n == 0:
        return []
    parent = (_root(namespace) if parent_hash is None else parent_hash).to_bytes(8, "big")
    if _chain_native is not None:
        out = (_PREFIXES.chain(parent, data, n, step, _chain_native) if PREFIX_CACHE
               else _chain_native(parent, data, 0, n * step, step))
    else:
        out = _chain_grouped(parent, data, n * step, step)
    hashes: list[int] = np.frombuffer(out, dtype=">u8").tolist()
    return hashes


def _chain_grouped(parent: bytes, buf: bytes | memoryview, end: int, step: int) -> bytes:
    """The pure-Python path: :func:`_chain_py` over runs of :data:`GROUP_BLOCKS` blocks of
    ``buf[:end]``, each run looked up first in the :data:`_GROUPS` LRU (keyed by the parent's
    8 bytes + the run's bytes). The C path does not use this LRU (its loop over a whole
    prompt costs less than the lookups) but :class:`_PrefixCache`."""
    h = parent
    out = bytearray()
    group = GROUP_BLOCKS * step
    for g0 in range(0, end, group):
        g1 = min(g0 + group, end)
        key = h + buf[g0:g1]
        got = _GROUPS.get(key)
        if got is None:
            got = _chain_py(h, buf, g0, g1, step)
            _GROUPS.put(key, got)
        out += got
        h = got[-8:]
    return bytes(out)


GROUP_BLOCKS = 32
"""Blocks per cached run (the reuse granularity of the pure-Python path)."""

CHECKPOINT_BLOCKS = 32
"""The C path's prefix cache keeps a prompt's hashes up to a multiple of this many blocks."""


class _PrefixCache:
    """The C path's cache of already hashed prompts, so that a session's next turn (its
    previous prompt + new tokens) hashes only its new blocks (issue 13 item 5).

    Rules:

    * An entry holds a hashed prompt's u32le tokens (the ``bytes`` object hashed, not a copy;
      a mutable buffer is copied first), the parent its chain started from, and its digests;
      it serves its first ``c`` blocks, ``c`` the largest multiple of :data:`CHECKPOINT_BLOCKS`
      it has. Prompts shorter than that are not cached (hashing them costs < 4 µs).
    * It is keyed by (parent, step, ``c``, the bytes of block ``c - 1``), and served for a
      prompt only when that prompt's first ``c`` blocks are byte for byte the entry's (a
      ``memcmp``) and its parent is the entry's: a hit gives exactly the digests a recompute
      gives, whatever the key matched. The parent is the namespace root (or the caller's
      ``parent_hash``), so a tenant (a ``cache_salt``) is only ever served its own chains.
    * A prompt takes the longest entry found at its checkpoints, largest first; at most
      :data:`PREFIX_MAX_TRIES` candidates that fail the comparison are tried, then it is
      hashed whole.
    * A prompt that reaches a checkpoint past the entry it was served from is kept as a new
      entry; the shorter one stays (other prompts may share that head: several questions on one
      long document, a regenerated turn).
    * Bounded: at most ``max_entries`` entries and ``max_bytes`` bytes of tokens and digests
      (least recently used go first; an entry that serves a prompt becomes the most recent).
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._d: OrderedDict[tuple[bytes, int, int, bytes], tuple[bytes, bytes, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.nbytes = 0

    def chain(self, parent: bytes, data: bytes | memoryview, n: int, step: int, chain_fn: _ChainFn) -> bytes:
        """The digests of ``n`` blocks of ``data`` chained from ``parent`` (``chain_fn``, the C
        ``chain``, hashes what the cache does not hold)."""
        g = CHECKPOINT_BLOCKS
        if n < g:
            return chain_fn(parent, data, 0, n * step, step)
        if not isinstance(data, bytes):
            data = bytes(data)  # what the cache keeps and compares must not change
        c, head = self._longest(parent, data, n, step)
        if c == n:
            return head[:8 * n]
        tail = chain_fn(head[8 * c - 8:8 * c] if c else parent, data, c * step, n * step, step)
        out = head[:8 * c] + tail if c else tail
        top = n // g * g
        if top > c:
            self._put(parent, data, top, step, out)
        return out

    def _longest(self, parent: bytes, data: bytes, n: int, step: int) -> tuple[int, bytes]:
        """(blocks served, the digests of an entry covering them) for the longest verified entry
        at ``data``'s checkpoints, or ``(0, b"")``."""
        g, tries = CHECKPOINT_BLOCKS, 0
        mv = memoryview(data)
        with self._lock:
            for c in range(n // g * g, 0, -g):
                key = (parent, step, c, bytes(mv[(c - 1) * step:c * step]))
                e = self._d.get(key)
                if e is None:
                    continue
                e_parent, e_data, e_digests = e
                if e_parent == parent and data.startswith(memoryview(e_data)[:c * step]):
                    self._d.move_to_end(key)
                    self.hits += 1
                    return c, e_digests
                tries += 1
                if tries >= PREFIX_MAX_TRIES:
                    break
            self.misses += 1
        return 0, b""

    def _put(self, parent: bytes, data: bytes, c: int, step: int, digests: bytes) -> None:
        """Keep ``data``'s first ``c`` blocks (``digests`` covers them)."""
        mv = memoryview(data)
        key = (parent, step, c, bytes(mv[(c - 1) * step:c * step]))
        with self._lock:
            prev = self._d.pop(key, None)
            if prev is not None:
                self.nbytes -= len(prev[1]) + len(prev[2])
            self._d[key] = (parent, data, digests)
            self.nbytes += len(data) + len(digests)
            while self._d and (len(self._d) > self.max_entries or self.nbytes > self.max_bytes):
                _, (_, d, h) = self._d.popitem(last=False)
                self.nbytes -= len(d) + len(h)

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.hits = self.misses = 0
            self.nbytes = 0


PREFIX_MAX_TRIES = 4
"""Candidates failing the byte comparison before a prompt is hashed whole."""


def _chain_py(parent: bytes, buf: bytes | memoryview, g0: int, g1: int, step: int) -> bytes:
    """Concatenated 8-byte digests of the blocks ``buf[g0:g1]`` chained from ``parent``
    (one ``hashlib.sha256`` call per block, ≈ 0.85 µs per 16-token block here; the C
    ``chain`` computes the same bytes in ≈ 0.14 µs with SHA-NI)."""
    sha = hashlib.sha256
    mv = memoryview(buf)
    h = parent
    out = bytearray()
    for i in range(g0, g1, step):
        h = sha(h + mv[i:i + step]).digest()[:8]
        out += h
    return bytes(out)


_ChainFn = Callable[[bytes, bytes | memoryview, int, int, int], bytes]
_U32leFn = Callable[[Sequence[int]], bytes | None]


def _load_native() -> tuple[_ChainFn, _U32leFn] | tuple[None, None]:
    """The C extension's ``chain`` and ``u32le`` (``cpd/kv/_chain_sha256.c``, built by
    ``pip install`` where a C compiler and the OpenSSL headers exist), or ``(None, None)``."""
    try:
        from cpd.kv import _chain_sha256
    except ImportError:
        return None, None
    return _chain_sha256.chain, _chain_sha256.u32le


_chain_native, _u32le_native = _load_native()
"""``None`` when the extension is not built: the pure-Python paths produce the same bytes
(compared in ``tests/unit/test_block_hash.py``)."""


def _u32le_bytes(token_ids: Sequence[int]) -> bytes:
    """Contiguous little-endian u32 bytes of the token ids (range-checked). A list or tuple of
    ints is packed by the C extension when built (≈ 5 ns per id against ≈ 10 – 13 for
    ``array.array``); anything else, or no extension, takes the paths below."""
    if _u32le_native is not None and (got := _u32le_native(token_ids)) is not None:
        return got
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
            raise ValueError("token ids must be in [0, 2**32)")
        return arr.astype("<u4", copy=False).tobytes()
    try:
        a = array.array("I", token_ids)
    except (OverflowError, TypeError):
        arr = np.asarray(token_ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise ValueError("token ids must be in [0, 2**32)") from None
        return arr.astype("<u4").tobytes()
    if _NATIVE_U32LE:
        return a.tobytes()
    return np.frombuffer(a.tobytes(), dtype=np.uint32).astype("<u4").tobytes()


_NATIVE_U32LE = array.array("I").itemsize == 4 and sys.byteorder == "little"


class _LRU:
    """A bounded, thread-safe LRU map (bytes → bytes): at most ``max_entries`` entries and
    ``max_bytes`` bytes of keys and values (the least recently used go first)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._d: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.nbytes = 0

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            v = self._d.get(key)
            if v is None:
                self.misses += 1
            else:
                self.hits += 1
                self._d.move_to_end(key)
            return v

    def put(self, key: bytes, value: bytes) -> None:
        with self._lock:
            old = self._d.get(key)
            if old is not None:
                self.nbytes -= len(key) + len(old)
            self._d[key] = value
            self._d.move_to_end(key)
            self.nbytes += len(key) + len(value)
            while self._d and (len(self._d) > self.max_entries or self.nbytes > self.max_bytes):
                k, v = self._d.popitem(last=False)
                self.nbytes -= len(k) + len(v)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.hits = self.misses = 0
            self.nbytes = 0


_GROUPS = _LRU(max_entries=8192, max_bytes=64 << 20)
"""≤ 8192 runs (≈ 19 MiB at block_size 16) and ≤ 64 MiB in all (≈ 1000 runs at block_size 512)."""
PREFIX_CACHE = True
"""Whether the C path uses :data:`_PREFIXES` (off: every prompt is hashed whole; for benchmarks)."""
_PREFIXES = _PrefixCache(max_entries=4096, max_bytes=64 << 20)
"""≤ 4096 prompts and ≤ 64 MiB of their tokens and digests (72 bytes per 16-token block: e.g.
≈ 110 prompts of 128K tokens, ≈ 450 of 32K)."""
_ROOTS: dict[Namespace, int] = {}


def _root(namespace: Namespace) -> int:
    r = _ROOTS.get(namespace)
    if r is None:
        if len(_ROOTS) > 4096:
            _ROOTS.clear()
        r = _ROOTS[namespace] = namespace.root_hash()
    return r


def hash_hex(h: int) -> str:
    """16-hex-digit rendering of a block hash (store keys, logs)."""
    return f"{h:016x}"
