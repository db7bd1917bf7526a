"""The L3 visibility protocol: when a chunk in the store may be read, and who is told.

A chunk moves ALLOCATED -> WRITING -> SEALED -> VISIBLE -> EVICTED (:class:`ChunkState`):

* **ALLOCATED** — :meth:`KVStore.begin_write` chose a private staging location for it
  (a temp file name / a staging key); nothing is stored yet.
* **WRITING** — its bytes go to the staging location (:meth:`PendingWrite.write`). No reader
  ever looks there, so a partial value is never read. A writer that dies leaves staging data
  that is reclaimed after ``stale_timeout_s`` (file: :meth:`reclaim_stale`; Redis: the staging
  key's TTL).
* **SEALED** — every byte is staged, and the backend's one atomic step publishes it under its
  final key, first sealer wins: ``link(temp, final)`` (file), rename-if-absent in a Lua script
  or ``SET NX`` of the whole value (Redis, where a command is applied whole or not at all, so
  WRITING and SEALED collapse into one step). A writer that loses the race discards its data.
* **VISIBLE** — readable at its final key, and announced: :meth:`Visibility.became_visible`
  publishes one ``BlockStored(medium="L3")`` per chunk. Only VISIBLE chunks count as hits
  anywhere (the router's L3 view, :mod:`cpd.router.l3_view`, learns them only from these events,
  from re-announcements, from store listings and from observations). A reader verifies the
  checksum (:mod:`cpd.store.chunk_format`); a corrupt value is invalidated (EVICTED) and the
  read is a miss.
* **EVICTED** — deleted (capacity LRU, :meth:`KVStore.delete`, a corrupt value invalidated,
  or the Redis server's own eviction/expiry seen by the watcher). :meth:`Visibility.evicted`
  publishes one ``BlockRemoved(medium="L3")`` per chunk, naming its blocks in chain order; only
  the process whose delete removed the chunk reports it.

Every backend goes through this module: :class:`PendingWrite` runs the state machine around
the backend's three hooks (stage bytes, atomic seal, discard), and every announcement of a
visibility change — stored, re-announced, removed — and every observation of what the store
holds is made by :class:`Visibility`, which each :class:`~cpd.store.base.KVStore` owns.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from cpd.kv.events import MEDIUM_L3, BlockRemoved, BlockStored, KVCacheEvent
from cpd.store.chunk_keys import ChunkKey

EventSink = Callable[[KVCacheEvent], None]


def _int_list(token_ids: Sequence[int]) -> list[int]:
    """A list of ints for an event: a ``list`` as given (callers pass fresh slices of int
    lists), any other sequence converted."""
    return token_ids if type(token_ids) is list else [int(t) for t in token_ids]


class ChunkState(enum.Enum):
    ALLOCATED = "allocated"
    WRITING = "writing"
    SEALED = "sealed"  # and VISIBLE: the backends seal and publish in one atomic step
    VISIBLE = "visible"
    EVICTED = "evicted"
    DISCARDED = "discarded"  # never visible: aborted, lost the seal race, partial or reclaimed


@dataclass
class Observation:
    """What one store call saw, for keeping an index of the store honest (issue 7 §6).

    Every candidate key ``(h, n)`` with ``h`` in ``block_hashes`` and ``1 <= n <= chunk_blocks``
    was checked at one moment; ``present`` are the ones found visible (and not found bad on
    read), ``gone`` the ones a read found missing or corrupt (corrupt ones were deleted). So for
    each ``h`` in ``block_hashes`` the chunks ending at ``h`` are exactly those in ``present``.
    ``checked_at_s``: ``time.monotonic()`` just before the check (a lower bound on its moment:
    whoever applies the observation must not let it undo what was learned after it)."""

    block_hashes: list[int]
    present: list[ChunkKey]
    gone: list[ChunkKey] = field(default_factory=list)
    checked_at_s: float = 0.0


ObservationSink = Callable[[Observation], None]


class Visibility:
    """Announces every visibility change of one store client's chunks (events) and what its
    probes and reads saw (observations). Sinks never break the data path: their errors are
    swallowed."""

    def __init__(self, event_sink: EventSink | None = None):
        self.event_sink = event_sink
        self.observation_sink: ObservationSink | None = None

    def _emit(self, ev: KVCacheEvent) -> None:
        if self.event_sink is not None:
            try:
                self.event_sink(ev)
            except Exception:  # a faulty sink must never break the data path
                pass

    def became_visible(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
                       block_size: int) -> None:
        """SEALED -> VISIBLE: ``BlockStored`` for ONE chunk (hashes in chain order)."""
        self._emit(BlockStored(block_hashes=[int(h) for h in hashes],
                               parent_block_hash=None if parent is None else int(parent),
                               token_ids=[] if token_ids is None else _int_list(token_ids),
                               block_size=int(block_size), medium=MEDIUM_L3))

    def reannounce(self, keys: Iterable[ChunkKey], hs: list[int], parent_block_hash: int | None,
                   token_ids: Sequence[int] | None, block_size: int) -> None:
        """Re-publish ``BlockStored`` for VISIBLE chunks lying wholly inside ``hs`` (a chain from
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
            self.became_visible(hs[s:j + 1], parent, toks, block_size)

    def evicted(self, hashes: Sequence[int]) -> None:
        """VISIBLE -> EVICTED: ``BlockRemoved`` for ONE chunk, its block hashes in chain order (or
        just its last hash when the others are unknown). One event per chunk, so that a reader
        keyed by chunk (:mod:`cpd.router.l3_view`) knows exactly which chunk went."""
        if hashes:
            self._emit(BlockRemoved(block_hashes=[int(h) for h in hashes], medium=MEDIUM_L3))

    def evicted_chunk(self, key: ChunkKey, hashes: Sequence[int]) -> None:
        """:meth:`evicted` for chunk ``key`` with the block hashes its bookkeeping or header
        named: all of them when they end at the key's hash and match its size, else only it."""
        ok = bool(hashes) and hashes[-1] == key[0] and len(hashes) == key[1]
        self.evicted(list(hashes) if ok else [key[0]])

    def observed(self, obs: Observation) -> None:
        """What a probe or read found (drained by the worker into each prefill answer)."""
        if self.observation_sink is not None:
            try:
                self.observation_sink(obs)
            except Exception:  # never break the data path
                pass


class PendingWrite(ABC):
    """One chunk on its way into the store: the ALLOCATED -> WRITING -> SEALED/VISIBLE state
    machine (or DISCARDED) around three backend hooks.

    ``write(fraction)`` stages the first ``fraction`` of the value's bytes (``1.0`` = all;
    partial writes exist to model a writer that dies mid-write); ``seal()`` makes a fully
    written value SEALED+VISIBLE atomically, announces it, and returns ``True`` if this writer
    won (first sealer wins; a loser's data is discarded); ``abort()`` discards staging data. A
    write never sealed is never visible.

    Backends implement :meth:`_stage` (write staged bytes up to a byte offset; return False if
    the staging data was reclaimed meanwhile), :meth:`_seal_atomic` (publish under the final
    key if absent; return whether this call did) and :meth:`_discard` (drop staging data)."""

    def __init__(self, key: ChunkKey, hashes: Sequence[int], total_bytes: int, visibility: Visibility):
        self.key = key
        self.hashes = [int(h) for h in hashes]
        self.total_bytes = int(total_bytes)
        self.written = 0
        self.state = ChunkState.ALLOCATED
        self.lost = False  # staging data reclaimed: can never seal
        self._visibility = visibility

    def write(self, fraction: float = 1.0) -> None:
        limit = int(self.total_bytes * min(max(fraction, 0.0), 1.0))
        if self.state not in (ChunkState.ALLOCATED, ChunkState.WRITING) or self.lost or limit <= self.written:
            return
        if not self._stage(limit):
            self.lost = True
            return
        self.state = ChunkState.WRITING
        self.written = limit

    def seal(self, announce: bool = True) -> bool:
        """SEALED+VISIBLE if fully written and first; ``announce=False`` when the caller
        announces the chunk itself (:meth:`KVStore.put_blocks`, which knows parent and tokens)."""
        if self.state not in (ChunkState.ALLOCATED, ChunkState.WRITING):
            return False
        if self.lost or self.written < self.total_bytes:
            self.abort()  # never make a partial or reclaimed value visible
            return False
        if not self._seal_atomic():
            self.state = ChunkState.DISCARDED
            return False
        self.state = ChunkState.VISIBLE
        if announce:
            self._visibility.became_visible(self.hashes, None, None, 0)
        return True

    def abort(self) -> None:
        if self.state in (ChunkState.VISIBLE, ChunkState.DISCARDED):
            return
        self.state = ChunkState.DISCARDED
        self._discard()

    @abstractmethod
    def _stage(self, limit: int) -> bool: ...

    @abstractmethod
    def _seal_atomic(self) -> bool: ...

    @abstractmethod
    def _discard(self) -> None: ...
