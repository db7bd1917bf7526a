"""The router's view of the shared L3 store, kept at the store's own granularity (issue 7 §6).

The store serves *chunks* — ``n`` consecutive blocks of one chain, named by their last block
hash (``cpd.store.base``). A request can load a chunk only if the chunk's last hash is one
of the request's block hashes, so a per-block view would promise blocks in the middle of a
chunk that the store cannot serve for that request. This view therefore holds what the store
holds: chunk keys ``(last_hash, n_blocks)``, and matches a request the way the store's
``lookup_prefix`` does (the longest run of leading blocks covered by chunks ending inside it).

It converges to the store from four sources:

* KV events: each L3 ``BlockStored``/``BlockRemoved`` names ONE chunk, its hashes in chain
  order (cpd stores publish one event per chunk; with ``chunk_blocks`` set, an event is cut
  into chunks of at most that many blocks from its start, as a per-block engine needs). A
  removal naming a chunk size that is not known removes every chunk ending at that hash.
* Observations reported by workers after they probed or read the store
  (:meth:`L3View.observe`): for every probed hash, exactly the chunks found there; plus the
  chunks a read found missing or corrupt. Nothing is inferred from ranges. An observation
  reaches the router after the probe it reports, possibly after a chunk was written and
  announced meanwhile (typically by the very request's own write-through), so it removes only
  chunks the view learned before ``since`` (a time before the probe); newer ones stay.
* Re-announcements: writers re-publish ``BlockStored`` for chunks that already exist.
* A snapshot (a store listing), taken at router start and after an event gap
  (:meth:`begin_resync` / :meth:`finish_resync`): events and observations that arrive
  while the listing is fetched are journaled and replayed on top of it, in order.

Not thread-safe: the owner (:class:`cpd.router.index.PrefixIndex`) serialises calls.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Sequence

ChunkKey = tuple[int, int]


class L3View:
    """Visible L3 chunks: last block hash → chunk sizes ending there.

    Args:
        chunk_blocks: None (default) = each event names exactly one chunk; an int = events are
            cut into chunks of at most this many blocks (1 for per-block publishers).
    """

    def __init__(self, chunk_blocks: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.chunk_blocks = chunk_blocks
        self._clock = clock
        self._ends: dict[int, dict[int, float]] = {}  # last hash -> {n_blocks: when learned}
        self._max_n = 1
        self._num_chunks = 0  # len of every _ends entry, kept as they change (sizes() is polled)
        self._num_blocks = 0  # sum of the n of every chunk
        self._journal: list[tuple[str, tuple]] | None = None

    # --- updates ---------------------------------------------------------------------
    def stored(self, hashes: Sequence[int]) -> None:
        """Apply one ``BlockStored(L3)``."""
        if self._journal is not None:
            self._log("stored", (list(hashes),))
        if self.chunk_blocks is None:  # one chunk per event (nearly all): no cutting
            if hashes:
                self._add((int(hashes[-1]), len(hashes)))
            return
        for key in self._pieces(hashes):
            self._add(key)

    def removed(self, hashes: Sequence[int]) -> None:
        """Apply one ``BlockRemoved(L3)``."""
        self._log("removed", (list(hashes),))
        for last, n in self._pieces(hashes):
            ns = self._ends.get(last)
            if not ns:
                continue
            if n in ns:
                del ns[n]
                self._num_chunks -= 1
                self._num_blocks -= n
            else:  # the event does not say which chunk: drop all ending there (relearned on use)
                self._num_chunks -= len(ns)
                self._num_blocks -= sum(ns)
                ns.clear()
            if not ns:
                del self._ends[last]

    def observe(self, block_hashes: Sequence[int], present: Iterable[ChunkKey], gone: Iterable[ChunkKey] = (),
                since: float | None = None) -> None:
        """Apply what a worker saw in the store: for each of ``block_hashes`` the chunks ending
        there are exactly those in ``present``; ``gone`` chunks were found missing/corrupt.
        ``since`` (this view's clock; None = no limit): removals spare chunks learned after
        it, which may be newer than the probe; chunks first learned here are dated ``since``."""
        present = [(int(h), int(n)) for h, n in present]
        gone = [(int(h), int(n)) for h, n in gone]
        if self._journal is not None:
            self._log("observe", (list(block_hashes), present, gone, since))
        seen = set(present)
        # only the hashes that end a known chunk need a look (a set intersection in C: a 128K-token
        # prompt names ~8K hashes, few of which end chunks); each (hash, n) is decided on its own
        for h in self._ends.keys() & block_hashes:  # the hashes are ints (or hash and compare as ints)
            for n in list(self._ends.get(h, ())):
                if (h, n) not in seen:
                    self._discard_older((h, n), since)
        for key in present:  # seen at the probe, i.e. at `since` at the latest: never re-dated later
            if key[1] not in self._ends.get(key[0], ()):
                self._add(key, since)
        for key in gone:
            self._discard_older(key, since)

    def discard(self, key: ChunkKey) -> None:
        self._discard_older(key, None)

    def _discard_older(self, key: ChunkKey, since: float | None) -> None:
        ns = self._ends.get(key[0])
        if ns is None or key[1] not in ns:
            return
        if since is None or ns[key[1]] <= since:
            del ns[key[1]]
            self._num_chunks -= 1
            self._num_blocks -= key[1]
            if not ns:
                del self._ends[key[0]]

    def begin_resync(self) -> None:
        """Start journaling updates: a store listing is being taken."""
        self._journal = []

    def finish_resync(self, keys: Iterable[ChunkKey]) -> None:
        """Replace the view by a store listing, then replay what arrived meanwhile."""
        journal, self._journal = self._journal or [], None
        self._ends = {}
        self._max_n = 1
        self._num_chunks = self._num_blocks = 0
        for key in keys:
            self._add((int(key[0]), int(key[1])))
        for op, args in journal:
            getattr(self, op)(*args)

    def abort_resync(self) -> None:
        self._journal = None

    @property
    def resyncing(self) -> bool:
        return self._journal is not None

    # --- queries ---------------------------------------------------------------------
    def leading(self, block_hashes: Sequence[int], max_blocks: int | None = None, start: int = 0) -> int:
        """End of the run of blocks of ``block_hashes[:max_blocks]`` the store can serve,
        covered by chunks whose last hash is among them (what ``KVStore.lookup_prefix``
        answers). ``start``: blocks before it are already held (the engine loads L3 after its
        L1/L2 run), so the run continues from there; a chunk may begin before ``start``."""
        hs = block_hashes if max_blocks is None else block_hashes[:max(0, max_blocks)]
        covered = start = min(max(0, start), len(hs))
        ends, max_n = self._ends, self._max_n
        for j in range(start, len(hs)):
            ns = ends.get(hs[j])
            if ns and j - max(ns) + 1 <= covered:
                covered = j + 1
            elif j - covered >= max_n:
                break  # no chunk ending further on can reach back to the covered run
        return covered

    def num_chunks(self) -> int:
        return self._num_chunks

    def num_blocks(self) -> int:
        """Blocks named by the chunks (a block in two chunks counts twice); kept as chunks come
        and go (the router's maintenance loop reads it every 0.2 s, under the index lock)."""
        return self._num_blocks

    def keys(self) -> list[ChunkKey]:
        return sorted((h, n) for h, ns in self._ends.items() for n in ns)

    # --- internals -------------------------------------------------------------------
    def _pieces(self, hashes: Sequence[int]) -> list[ChunkKey]:
        hs = [int(h) for h in hashes]
        if not hs:
            return []
        step = self.chunk_blocks or len(hs)
        return [(hs[min(s + step, len(hs)) - 1], min(s + step, len(hs)) - s) for s in range(0, len(hs), step)]

    def _add(self, key: ChunkKey, learned_at: float | None = None) -> None:
        ns = self._ends.setdefault(key[0], {})
        if key[1] not in ns:
            self._num_chunks += 1
            self._num_blocks += key[1]
        ns[key[1]] = self._clock() if learned_at is None else learned_at
        if key[1] > self._max_n:
            self._max_n = key[1]

    def _log(self, op: str, args: tuple) -> None:
        if self._journal is not None:
            self._journal.append((op, args))
