"""A streamed NDJSON answer whose cleanup runs even when its body never started.

Starlette's ``StreamingResponse`` listens for the client's disconnect while it streams and cancels
the body then. A caller gone before the body's first step (the router died, or hung up, while this
worker was stopped or busy) means the body generator never runs, so its ``finally`` never does
either: an engine request nobody reads kept running to its end, its stream record stayed open and
its handoff staging was never released. :class:`NDJSONStream` runs ``on_unstarted`` in that case.
"""
from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse


class NDJSONStream(StreamingResponse):
    """``application/x-ndjson`` lines from ``body``; ``on_unstarted()`` runs once the response is
    over if ``body`` was never iterated."""

    def __init__(self, body: AsyncIterator[bytes], on_unstarted: Callable[[], None]):
        self._started = False
        self._on_unstarted = on_unstarted

        async def tracked() -> AsyncIterator[bytes]:
            self._started = True
            async with aclosing(body) as lines:  # type: ignore[type-var]  # an async generator
                async for chunk in lines:
                    yield chunk
        super().__init__(tracked(), media_type="application/x-ndjson")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._started:
                self._on_unstarted()
