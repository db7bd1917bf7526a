"""The simulator's L3 connector: a write-through lands when the step that computed it ends.

Live, the engine hands a step's newly full blocks to the :class:`~cpd.store.connector.L3Connector`
inside ``Engine.step()`` and its writer thread stores them afterwards, so no other worker can load
them before the step that computes them has finished. The simulator runs a step at once and
delivers its outputs ``dt`` later on the virtual clock; a synchronous write inside the step would
make the blocks visible at the step's *start*, and another worker could load KV whose computation
had not ended (modeled-ordering `pd-l3` at 6 QPS: 0.73 goodput with the early writes, 0.66 with
writes at the step's end; docs/results/modeled_ordering/README.md, session 11). This connector
keeps the saves of a step (copied, as the live connector copies them for its writer) until the
simulator applies them at the step's end (:meth:`apply_pending`), with their L3 events.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from cpd.engine.connector import EventSink
from cpd.store.base import KVStore
from cpd.store.connector import L3Connector


class StepEndL3Connector(L3Connector):
    """:class:`L3Connector` (synchronous writes) whose saves wait for :meth:`apply_pending`."""

    def __init__(self, store: KVStore, event_sink: EventSink | None = None) -> None:
        super().__init__(store, event_sink=event_sink, write_async=False)
        self._pending: list[tuple[list[int], int | None, list[int], list[np.ndarray]]] = []

    def save(self, block_hashes: Sequence[int], parent_block_hash: int | None,
             token_ids: Sequence[int], blocks: Sequence[np.ndarray]) -> None:
        if block_hashes:
            self._pending.append(([int(h) for h in block_hashes], parent_block_hash, list(token_ids),
                                  [np.array(b, copy=True) for b in blocks]))

    @property
    def num_pending_saves(self) -> int:
        return len(self._pending)

    def apply_pending(self) -> None:
        """Write every save held since the last call, in order (store faults are counted)."""
        jobs, self._pending = self._pending, []
        for job in jobs:
            self._write(job)
