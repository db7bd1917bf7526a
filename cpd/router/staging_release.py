"""Releases of handoff stagings nobody will fetch (``POST /handoff/release``), retried until the
worker answers.

A release that fails in transport (the prefill worker stopped, restarting or cut off from the
router at that moment) used to be dropped: the staging then held its arena region and KV blocks
until the worker's own reclaim (``handoff.reclaim_after_s``, 120 s by default), however soon the
worker came back. Here a release is retried with exponential backoff (0.5 s, doubling, at most
8 s apart) for at most ``timeouts.release_retry_s`` after it was first sent, and stops at the
worker's first answer, whatever its status (a staging already gone answers too). Pending
releases are bounded (``max_pending``): beyond it a release is not retried but counted
(``cpd_fallbacks_total{kind="release_dropped"}``): the sender's reclaim still frees it.
"""
from __future__ import annotations

import asyncio
import time

import httpx

from cpd.messages.handoff import HandoffRelease
from cpd.messages.worker_api import encode
from cpd.router.decode_relay import JSON_HEADERS
from cpd.router.metrics import RouterMetrics
from cpd.router.timeouts import DispatchTimeouts

FIRST_RETRY_S = 0.5
MAX_RETRY_GAP_S = 8.0


class StagingReleaser:
    """Sends :class:`HandoffRelease` messages in the background, each retried until answered."""

    def __init__(self, timeouts: DispatchTimeouts, metrics: RouterMetrics, max_pending: int = 1024):
        self.timeouts, self.metrics = timeouts, metrics
        self.max_pending = max_pending
        self._pending: set[asyncio.Task] = set()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def release(self, client: httpx.AsyncClient, url: str, msg: HandoffRelease) -> None:
        """Fire-and-forget: POST ``msg`` to ``url`` until the worker answers (or the bound)."""
        if len(self._pending) >= self.max_pending:
            self.metrics.fallbacks.labels("release_dropped").inc()
            return
        task = asyncio.get_running_loop().create_task(self._until_answered(client, url, encode(msg)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _until_answered(self, client: httpx.AsyncClient, url: str, body: bytes) -> None:
        give_up_at = time.monotonic() + self.timeouts.release_retry_s
        gap_s = FIRST_RETRY_S
        while True:
            try:
                await client.post(url, content=body, headers=JSON_HEADERS, timeout=self.timeouts.release_s)
                return
            except httpx.HTTPError:
                if time.monotonic() + gap_s > give_up_at:
                    self.metrics.fallbacks.labels("release_unanswered").inc()
                    return
                self.metrics.fallbacks.labels("release_retry").inc()
                await asyncio.sleep(gap_s)
                gap_s = min(2 * gap_s, MAX_RETRY_GAP_S)

    async def aclose(self) -> None:
        """Cancel the pending releases (the router is stopping: the senders' reclaim frees them)."""
        for t in list(self._pending):
            t.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
