"""Contract between the engine and the L3 store (after vLLM's KV-connector API).

The engine owns L1 (paged device pool) and L2 (host pool). Everything beyond the
worker — the shared L3 store — is reached only through a :class:`KVConnector`,
which the worker builds from ``cpd.store``.

KV layout of one block, everywhere (pool, L2, L3 payloads, handoff):
``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``, C-contiguous, in the
engine's KV dtype. ``block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize``.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np

from cpd.kv.events import KVCacheEvent

EventSink = Callable[[KVCacheEvent], None]
"""Receives each KV event as it happens (the worker batches and publishes them)."""


class KVConnector(Protocol):
    """The engine's view of the L3 store. Implementations must never raise on
    store faults from ``lookup``/``load``: they return 0 / ``None`` so the engine
    recomputes (docs/architecture.md 'Fallbacks')."""

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``block_hashes`` that are VISIBLE in L3."""
        ...

    def load(self, block_hashes: Sequence[int]) -> list[np.ndarray] | None:
        """Read these blocks (checksums verified). Returns one array per block, each of
        the block layout above, or ``None`` if any block is missing or corrupt (the
        engine then recomputes them; the connector invalidates what was corrupt)."""
        ...

    # Optional (used when present, see cpd.store.connector.L3Connector):
    #   lookup_and_announce(block_hashes, parent_block_hash, token_ids, block_size) -> int
    #       like lookup for a writer, and re-publishes BlockStored(L3) for the visible chunks
    #       found, so an index that lost them (router restart, lost events) relearns them.
    #       token_ids start at the chain's first block and may run past its last (the engine
    #       passes its request's whole list rather than a copy of the prefix).

    def save(self, block_hashes: Sequence[int], parent_block_hash: int | None,
             token_ids: Sequence[int], blocks: Sequence[np.ndarray]) -> None:
        """Write-through of full, computed blocks (``token_ids`` = their tokens, flat).
        May return before the write completes; blocks become visible only when sealed."""
        ...
