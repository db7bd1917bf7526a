"""Server-sent events: ``data: <json>`` lines, ``[DONE]``, and a response driven by a producer
that is cancelled when the client disconnects."""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from fastapi.responses import Response

from cpd.router.openai_front.cancel import CancelOnDisconnect, ClientGone


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class SSEResponse(Response):
    """A ``text/event-stream`` response driven by ``producer(emit)``.

    While the producer runs, the response also listens for ``http.disconnect``; on
    disconnect it cancels the producer (whose ``finally`` closes the backend generator).
    This does not depend on the ASGI server's spec version or on a send() failing.
    The producer runs in the request's own task.
    """

    media_type = "text/event-stream"

    def __init__(self, producer: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]]):
        # no Response.__init__: it would set a body and "content-length: 0"
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._producer = producer

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})

        watch = CancelOnDisconnect(receive)

        async def emit(data: bytes) -> None:
            if watch.gone:  # the client left (a lost cancellation must not keep the producer going)
                raise ClientGone()
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            async with watch:
                await self._producer(emit)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):
            pass   # the producer's finally has closed the backend generator
