"""The engine's L3 connector: :class:`cpd.engine.connector.KVConnector` over a :class:`KVStore`.

Fallbacks (docs/architecture.md): ``lookup``/``load`` never raise on store faults — an unreachable store
or a corrupt/missing value yields 0 / ``None`` and is counted in :attr:`L3Connector.fallback_counts`
by kind:

* ``"unavailable"`` — :class:`StoreUnavailable` in lookup/load/save (refused, reset, gone);
* ``"timeout"`` — :class:`StoreTimeout`: the store did not answer within its ``timeout_s``
  (slow or stalled store);
* ``"corrupt"`` — a checksum/header mismatch on load (the entry was invalidated);
* ``"miss"`` — load found a block missing (e.g. evicted after lookup: a stale index);
* ``"queue_full"`` — an async save dropped because the write queue was full;
* ``"write_error"`` — any other exception while saving (logged in :attr:`last_error`).

Observations (issue 7 §6): every probe and read the store makes reports what it found
(:class:`~cpd.store.base.Observation`: for each probed block hash, exactly which chunks end
there; which chunks a read found missing or corrupt). The connector keeps the latest
``max_observations`` of them; the worker hands them to the router with each prefill answer
(:meth:`L3Connector.drain_observations`), so the router's L3 index converges to what the
store can serve — removing exactly what is gone, relearning what it lost.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Sequence

import numpy as np

from cpd.engine.connector import EventSink
from cpd.store.base import KVStore, Observation, StoreTimeout, StoreUnavailable


class L3Connector:
    """Implements :class:`cpd.engine.connector.KVConnector`.

    Args:
        store: the L3 store client.
        event_sink: if given, becomes ``store.event_sink`` (L3 ``BlockStored``/``BlockRemoved``).
        on_written: called by the writer thread after each background write (the worker passes
            its event publisher's ``flush``: a write-through's ``BlockStored(L3)`` goes out as soon
            as the blocks are readable, not with the flush after the engine's next step, which
            may be a long prefill later).
        write_async: hand saves to one background writer thread. Blocks are copied on
            ``save`` so the engine may reuse its buffers immediately.
        max_queue: pending saves (calls) before new ones are dropped.
        max_pending_bytes: pending payload bytes before new saves are dropped.
        max_observations: store observations kept until drained (oldest dropped first).
    """

    def __init__(self, store: KVStore, event_sink: EventSink | None = None, write_async: bool = True,
                 max_queue: int = 64, max_pending_bytes: int = 512 << 20, max_observations: int = 256,
                 on_written: Callable[[], object] | None = None):
        self.store = store
        self.on_written = on_written
        if event_sink is not None:
            store.event_sink = event_sink
        self._observations: deque[Observation] = deque(maxlen=max_observations)
        store.observation_sink = self._observations.append
        self.write_async = write_async
        self.fallback_counts: Counter[str] = Counter()
        self.blocks_saved = 0
        self.last_error: BaseException | None = None
        self.max_pending_bytes = int(max_pending_bytes)
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self._closed = False
        if write_async:
            self._thread = threading.Thread(target=self._run, name="l3-writer", daemon=True)
            self._thread.start()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.fallback_counts[kind] += 1

    # ---- KVConnector ----------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Leading blocks VISIBLE in L3; 0 if the store is unreachable."""
        return self._lookup_prefix(block_hashes)

    def lookup_and_announce(self, block_hashes: Sequence[int], parent_block_hash: int | None,
                            token_ids: Sequence[int], block_size: int) -> int:
        """For a writer: leading blocks of a chain (``block_hashes`` from its first block) that
        are VISIBLE in L3 — these need no write — and re-publish ``BlockStored(L3)`` for the
        chunks covering them, so an index that lost them relearns them. 0 if unreachable."""
        return self._lookup_prefix(block_hashes, announce=True, parent_block_hash=parent_block_hash,
                                   token_ids=token_ids, block_size=block_size)

    def _lookup_prefix(self, block_hashes: Sequence[int], **announce: Any) -> int:
        """``store.lookup_prefix``, with a store fault counted and read as a miss (0)."""
        try:
            return self.store.lookup_prefix(block_hashes, **announce)
        except StoreTimeout:
            self._count("timeout")
            return 0
        except StoreUnavailable:
            self._count("unavailable")
            return 0

    def drain_observations(self) -> list[dict]:
        """Observations since the last call, oldest first, as JSON-ready dicts
        ``{"block_hashes": [...], "present": [[h, n], ...], "gone": [[h, n], ...],
        "checked_at_s": t}`` (``t``: this process's ``time.monotonic()`` before the check)."""
        out: list[dict] = []
        while True:
            try:
                o = self._observations.popleft()
            except IndexError:
                return out
            out.append({"block_hashes": o.block_hashes, "present": [list(k) for k in o.present],
                        "gone": [list(k) for k in o.gone], "checked_at_s": o.checked_at_s})

    def load(self, block_hashes: Sequence[int]) -> list[np.ndarray] | None:
        """One array per block (checksum verified) or ``None`` (miss / corrupt / unreachable).
        (Load bandwidth is measured by the engine: ``Engine.l3_load_bytes`` / ``l3_load_seconds``.)"""
        try:
            blocks, reason = self.store.read_blocks(block_hashes)
        except StoreTimeout:
            self._count("timeout")
            return None
        except StoreUnavailable:
            self._count("unavailable")
            return None
        if blocks is None:
            self._count(reason)
            return None
        return blocks

    def save(self, block_hashes: Sequence[int], parent_block_hash: int | None,
             token_ids: Sequence[int], blocks: Sequence[np.ndarray]) -> None:
        """Write-through of full blocks. Async: copies the blocks and enqueues (dropped and
        counted as ``"queue_full"`` when the queue or byte budget is full). Sync: writes now;
        store faults are counted, never raised."""
        if not block_hashes:
            return
        job = ([int(h) for h in block_hashes], parent_block_hash, list(token_ids), blocks)
        if not self.write_async:
            self._write(job)
            return
        nbytes = sum(int(b.nbytes) for b in blocks)
        with self._lock:
            if self._closed or self._pending_bytes + nbytes > self.max_pending_bytes:
                self.fallback_counts["queue_full"] += 1
                return
            self._pending_bytes += nbytes
        job = (job[0], job[1], job[2], [np.array(b, copy=True) for b in blocks])
        try:
            self._q.put_nowait((job, nbytes))
        except queue.Full:
            with self._lock:
                self._pending_bytes -= nbytes
                self.fallback_counts["queue_full"] += 1

    # ---- writer ---------------------------------------------------------------------------
    def _write(self, job) -> None:
        hashes, parent, toks, blocks = job
        try:
            n = self.store.put_blocks(hashes, blocks, parent_block_hash=parent, token_ids=toks or None)
            with self._lock:
                self.blocks_saved += n
        except StoreTimeout:
            self._count("timeout")
        except StoreUnavailable:
            self._count("unavailable")
        except Exception as e:  # never let a bad write kill the writer thread
            self.last_error = e
            self._count("write_error")

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            job, nbytes = item
            try:
                self._write(job)
                if self.on_written is not None:
                    self.on_written()
            except Exception as e:  # a failing hook never kills the writer thread
                self.last_error = e
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
                self._q.task_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued saves are written. Returns False on timeout."""
        if self._thread is None:
            return True
        if timeout_s is None:
            self._q.join()
            return True
        end = time.monotonic() + timeout_s
        while self._q.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float | None = 30.0) -> None:
        """Flush pending saves, stop the writer, close the store (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self.flush(timeout_s)
            self._q.put(None)
            self._thread.join(timeout_s)
        self.store.close()

    def __enter__(self) -> "L3Connector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
