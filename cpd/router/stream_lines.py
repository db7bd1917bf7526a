"""Reading a worker's NDJSON stream (a decode's lines, a prefill's progress lines) so that the
router's own pauses are never taken for the worker's silence (:class:`LineReader`)."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from cpd.router.timeouts import WORKER_LINE_INTERVAL_S

LISTEN_GRACE_S = 2 * WORKER_LINE_INTERVAL_S
MAX_RELISTENS = 2  # a router starved past every grace still calls a silent worker silent


class LineReader:
    """A worker stream's next line (of ``httpx.Response.aiter_lines()``), awaited without cancelling
    the read, so a wait that ends can be resumed. The router's own pauses are not the worker's silence: every wait lasts at least
    ``LISTEN_GRACE_S`` (after the relay was held past its deadline by its consumer — a client that
    reads slowly, the event loop busy — what the worker sent meanwhile is read first), and a wait
    the router overslept by more than a grace (its process stopped or starved) listens again for a
    grace (at most ``MAX_RELISTENS`` times) before the worker is called silent."""

    def __init__(self, lines: AsyncIterator[str]):
        self._lines = lines.__aiter__()
        self._next: asyncio.Future | None = None

    async def next(self, deadline_s: float) -> str | None:
        """The next line; None when none came by ``deadline_s`` (monotonic clock; at least a grace
        from now). Raises ``StopAsyncIteration`` at the stream's end."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._lines.__anext__())
        for _ in range(MAX_RELISTENS + 1):
            timeout_s = max(LISTEN_GRACE_S, deadline_s - time.monotonic())
            t0 = time.monotonic()
            done, _ = await asyncio.wait({self._next}, timeout=timeout_s)
            if done:
                fut, self._next = self._next, None
                return fut.result()
            if time.monotonic() - t0 <= timeout_s + LISTEN_GRACE_S:
                return None
            # overslept (the router was paused): the deadline has passed, listen once more for a grace
        return None

    async def aclose(self) -> None:
        if self._next is not None:
            self._next.cancel()
            await asyncio.gather(self._next, return_exceptions=True)
            self._next = None
