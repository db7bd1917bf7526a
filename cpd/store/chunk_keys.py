"""Chunk keys ``(last_block_hash, n_blocks)``: how a chain of blocks is cut into chunks and how
a prefix is found among chunks of any size.

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
"""
from __future__ import annotations

from typing import Sequence

ChunkKey = tuple[int, int]
"""``(last_block_hash, n_blocks)`` — the key of one chunk."""


def split_chunks(n_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges of consecutive chunks of at most ``chunk_blocks`` blocks."""
    return [(s, min(s + chunk_blocks, n_blocks)) for s in range(0, n_blocks, chunk_blocks)]


def cover(present: dict[ChunkKey, bool], block_hashes: Sequence[int], chunk_blocks: int
          ) -> tuple[int, list[tuple[int, int, ChunkKey]]]:
    """Longest run of leading blocks covered by present chunks, and a minimal chain of chunks
    covering it as ``(start_pos, end_pos_inclusive, key)``; ``start_pos`` may be negative (the
    chunk begins before the first requested block)."""
    if chunk_blocks == 1:  # one chunk per block: the chain is the run of present blocks
        chain1 = []
        for j, h in enumerate(block_hashes):
            if not present.get((h, 1)):
                break
            chain1.append((j, j, (h, 1)))
        return len(chain1), chain1
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


def candidate_keys(block_hashes: Sequence[int], chunk_blocks: int) -> list[ChunkKey]:
    return [(int(h), n) for h in block_hashes for n in range(1, chunk_blocks + 1)]
