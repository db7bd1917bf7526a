"""The L3 KV store interface (:class:`KVStore`): what every backend (``file://``, ``redis://``,
``redis+cluster://``) offers, built on a handful of backend primitives.

The concepts it builds on each live in their own module:

* :mod:`cpd.store.chunk_keys` — chunks keyed by ``(last_block_hash, n_blocks)``, how a chain is
  cut into chunks and how a prefix is found among chunks of any size;
* :mod:`cpd.store.chunk_format` — the value format (header, payload, xxh3 checksum trailer);
* :mod:`cpd.store.visibility` — the visibility protocol (ALLOCATED -> WRITING -> SEALED ->
  VISIBLE -> EVICTED), the write state machine and every announcement (events, observations);
* :mod:`cpd.store.errors` — :class:`StoreUnavailable` (the one fault every call may raise).
"""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from cpd.store.chunk_format import decode_value, encode_chunks, infer_block_size, readable_header_hashes
from cpd.store.chunk_keys import ChunkKey, candidate_keys, cover, split_chunks
from cpd.store.errors import CorruptValue, StoreTimeout, StoreUnavailable
from cpd.store.visibility import EventSink, Observation, ObservationSink, PendingWrite, Visibility

__all__ = ["DEFAULT_STALE_TIMEOUT_S", "ChunkKey", "EventSink", "KVStore", "Observation", "PendingWrite",
           "StoreStats", "StoreTimeout", "StoreUnavailable"]

DEFAULT_STALE_TIMEOUT_S = 30.0


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
        self.visibility = Visibility(event_sink)
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

    # ---- visibility (cpd.store.visibility) ----------------------------------------------
    @property
    def event_sink(self) -> EventSink | None:
        """Receives ``BlockStored``/``BlockRemoved`` (``medium="L3"``) for this client's chunks."""
        return self.visibility.event_sink

    @event_sink.setter
    def event_sink(self, sink: EventSink | None) -> None:
        self.visibility.event_sink = sink

    @property
    def observation_sink(self) -> ObservationSink | None:
        """Receives an :class:`Observation` for every probe and read."""
        return self.visibility.observation_sink

    @observation_sink.setter
    def observation_sink(self, sink: ObservationSink | None) -> None:
        self.visibility.observation_sink = sink

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
        items = list(zip([(hs_all[e - 1], e - s) for s, e in ranges], encode_chunks(hs_all, blocks, ranges, bs)))
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
            self.visibility.became_visible(hs_all[s:e], parent, toks, bs)
        self.visibility.reannounce(lost, hs_all, parent_block_hash, token_ids, bs)
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
        kept, dropped = [], 0
        for s, e in ranges:
            if all(covered[s:e]):
                dropped += e - s
            else:
                kept.append((s, e))
        self._bump(blocks_dropped_existing=dropped)
        self.visibility.reannounce(present, hs, parent_block_hash, token_ids, bs)
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
        t = time.monotonic()
        present = dict(zip(keys, self._exists_many(keys)))
        self.visibility.observed(Observation(hs, [k for k, there in present.items() if there], checked_at_s=t))
        covered, chain = cover(present, hs, self.chunk_blocks)
        if announce:
            self.visibility.reannounce([c[2] for c in chain], hs, parent_block_hash, token_ids, block_size)
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
        t = time.monotonic()
        if self.chunk_blocks == 1:
            # one key per block: no probe needed, fetch everything in one round trip
            chain = [(j, j, (h, 1)) for j, h in enumerate(hs)]
            present = {c[2]: True for c in chain}
        else:
            keys = candidate_keys(hs, self.chunk_blocks)
            present = dict(zip(keys, self._exists_many(keys)))
            covered, chain = cover(present, hs, self.chunk_blocks)
            if covered < len(hs):
                self.visibility.observed(Observation(hs, [k for k, there in present.items() if there],
                                                     checked_at_s=t))
                self._bump(misses=1)
                return None, "miss"
        out, reason, gone = self._read_chain(hs, chain)
        self.visibility.observed(Observation(hs, [k for k, there in present.items() if there and k not in gone], gone,
                                             checked_at_s=t))
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
        """A value failed verification: delete it if unchanged since read (VISIBLE -> EVICTED)."""
        self._bump(corrupt=1)
        mv = memoryview(raw).cast("B")
        trailer = bytes(mv[-8:]) if mv.nbytes >= 8 else None
        if self._invalidate(key, trailer):
            self.visibility.evicted(readable_header_hashes(key, raw))

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
                self.visibility.evicted(hs[j - n + 1:j + 1] if j - n + 1 >= 0 else [last])
        return sum(gone)

    def clear(self) -> int:
        """Delete every visible chunk (and stale staging data); emits one ``BlockRemoved`` per
        chunk (its last hash). Returns chunks removed. Raises: StoreUnavailable."""
        keys = self.list_visible()
        gone = self._delete_keys(keys) if keys else []
        for k, g in zip(keys, gone):
            if g:
                self.visibility.evicted([k[0]])
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
