"""Client disconnects: closing the backend generator, and cancelling the request's own task
when the ASGI server reports ``http.disconnect``."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Mapping

log = logging.getLogger("cpd.router.openai_front")


async def aclose_quietly(agen: Any) -> None:
    close = getattr(agen, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:  # a backend failing to close must not mask the real outcome
        log.exception("backend generator raised while closing")


async def wait_disconnect(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    """Return when the ASGI server reports ``http.disconnect`` (call only after the body
    has been read completely)."""
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            return


class ClientGone(Exception):
    pass


class CancelOnDisconnect:
    """``async with CancelOnDisconnect(receive):`` — if the client disconnects while the body
    runs, the *current* task is cancelled and the block raises :class:`ClientGone`.

    Cancelling the current task (instead of running the work in a helper task) keeps every
    step of the backend generator in one task, so generators that hold task-bound state
    across ``yield`` (anyio cancel scopes, context variables) keep working. Call only after
    the request body has been read completely.
    """

    def __init__(self, receive: Callable[[], Awaitable[Mapping[str, Any]]]):
        self._receive = receive
        self.gone = False

    async def __aenter__(self) -> "CancelOnDisconnect":
        task = asyncio.current_task()
        assert task is not None  # entered from a coroutine running in a task
        self._task = task
        self._watch = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        await wait_disconnect(self._receive)
        self.gone = True
        self._task.cancel()

    async def __aexit__(self, et, exc, tb) -> bool:
        self._watch.cancel()
        if not self.gone:
            return False
        uncancel = getattr(self._task, "uncancel", None)   # Python >= 3.11
        if uncancel is not None:
            uncancel()
        if et is None or issubclass(et, (asyncio.CancelledError, ClientGone)):
            raise ClientGone()
        return False
