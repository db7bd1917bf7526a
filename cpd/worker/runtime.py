"""A worker's moving parts: one engine stepped by one thread, outputs delivered to
asyncio waiters, KV events flushed after every step.

Threading model: the engine thread is the only one that calls ``Engine.step``;
handlers on the asyncio loop call ``add_request``/``abort`` (thread-safe in the
engine) and run ``export_kv``/``add_decode_request`` under :attr:`engine_lock`,
which the engine thread also holds during a step.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from cpd.kv.event_bus import EventPublisher


@dataclass
class RequestStream:
    """Per-request delivery of engine outputs to the asyncio loop."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class EngineRunner:
    """Runs ``engine.step()`` in a dedicated thread while there is work."""

    def __init__(self, engine, publisher: EventPublisher | None):
        self.engine = engine
        self.publisher = publisher
        self.engine_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.num_steps = 0
        self.last_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def open_stream(self, request_id: str) -> RequestStream:
        s = RequestStream(asyncio.Queue(), asyncio.get_running_loop())
        with self._streams_lock:
            self._streams[request_id] = s
        return s

    def close_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    def submit(self, engine_request) -> RequestStream:
        """Register a stream and add the request to the engine."""
        s = self.open_stream(engine_request.request_id)
        self.engine.add_request(engine_request)
        self._wake.set()
        return s

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self.close_stream(request_id)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                if self.publisher is not None:
                    self.publisher.flush()
                continue
            try:
                with self.engine_lock:
                    outputs = self.engine.step()
            except BaseException as e:  # surface engine bugs to every waiter, never hang
                self.last_error = e
                self._fail_all(e)
                continue
            self.num_steps += 1
            if self.publisher is not None:
                self.publisher.flush()
            self._deliver(outputs)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            with self._streams_lock:
                s = self._streams.get(out.request_id)
            if s is not None:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.items())
        for rid, s in streams:
            self.engine.abort(rid)
            s.loop.call_soon_threadsafe(s.queue.put_nowait, exc)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
