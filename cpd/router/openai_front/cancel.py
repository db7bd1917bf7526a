"""Client disconnects: closing the backend generator, and cancelling the request's own task
when the ASGI server reports ``http.disconnect``."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Mapping

log = logging.getLogger("cpd.router.openai_front")
RECANCEL_S = 1.0  # after a disconnect, the block is cancelled again this often until it ends


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

    A cancellation can be lost: ``asyncio.wait_for`` before Python 3.12 returns its inner
    result instead of raising when the cancellation races with that result (seen live: about
    one streamed request in ten kept generating for a client that had left, and counted as
    ``ok``). So the task is cancelled again every :data:`RECANCEL_S` until the block ends, and
    :attr:`gone` lets code that writes to the client stop at once (``SSEResponse``'s ``emit``).
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
        while True:  # ends when __aexit__ cancels this watcher
            self._task.cancel()
            await asyncio.sleep(RECANCEL_S)

    async def __aexit__(self, et, exc, tb) -> bool:
        self._watch.cancel()
        if not self.gone:
            return False
        uncancel = getattr(self._task, "uncancel", None)   # Python >= 3.11
        if uncancel is not None:
            while self._task.cancelling():  # every cancellation this block requested
                uncancel()
        if et is None or issubclass(et, (asyncio.CancelledError, ClientGone)):
            raise ClientGone()
        return False
