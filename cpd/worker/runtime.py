"""A worker's moving parts: one engine stepped by one thread, outputs delivered to
asyncio waiters, KV events flushed after every step.

Threading model: the engine thread is the only one that calls ``Engine.step``;
handlers on the asyncio loop call ``add_request``/``abort`` (thread-safe in the
engine) and run ``add_decode_request`` (and snapshots) under :attr:`engine_lock`,
which the engine thread also holds during a step; a waiting handler goes before the next
step (:class:`HandlerFirstLock`).

Handoff staging: a prefill-mode request's KV is staged by the engine thread itself, right after
the step that produced its first token and before that token is delivered (``stage_handoff``,
installed by the worker). Staged from a handler thread instead, it waited for the engine lock,
which the engine thread takes again at once for its next step: under a queue the handoff (and
the TTFT) waited one or more whole steps — 2-4 s per request in a live Mooncake replay.

Failures (issue 7 §2): a request the engine finishes with ``"error"`` gets a
:class:`RequestFailed` on its stream (its handler answers an error for that request
only). A step the engine itself failed (its canary forward failed too), or an exception
escaping ``Engine.step`` (an engine bug: every live request is failed, as nothing tells which
one caused it), counts as a failed step in :class:`StepHealth`; a bad request failing alone
does not. The worker reports unhealthy only while its engine keeps failing (see there; an idle
one is probed), never because of one old error. A step that does not end (a hung kernel,
a deadlock) is seen from outside the engine thread: while the current step has run longer than
``max_step_s`` the worker is *stuck* and reports unhealthy (:meth:`EngineRunner.health`); so is
one whose engine thread is gone. Nothing after a step (event flush, delivery to a stream whose
event loop has closed) can end the thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from cpd.engine.kv_pool import NoFreeBlocks
from cpd.kv.event_bus import EventPublisher


class RequestFailed(RuntimeError):
    """Delivered on a request's stream when the engine failed that request. ``engine_failed``:
    the engine itself was at fault (its canary forward failed too), not the request: the caller
    may retry it on another worker."""

    def __init__(self, message: str, engine_failed: bool = False):
        super().__init__(message)
        self.engine_failed = engine_failed


@dataclass
class RequestStream:
    """Per-request delivery of engine outputs to the asyncio loop."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class StepHealth:
    """Health from the engine's recent steps: a circuit breaker, not a sticky flag.

    A *failed step* is one the engine itself failed (:attr:`cpd.engine.engine.Engine.last_step_error`:
    nothing of the step ran and a canary forward failed too), or an exception escaping the step;
    a bad request that fails alone is not one. Unhealthy while the last ``max_consecutive_failures``
    (or more) steps or probes all failed; a good step or probe clears it at once. An idle engine
    whose last step failed is probed every ``retry_after_s`` by the runner
    (:meth:`EngineRunner._probe_if_due`): a client's request is never the probe. One confirmed
    failure is enough by default, as the canary already took the second look.
    """

    def __init__(self, max_consecutive_failures: int = 1, retry_after_s: float = 5.0):
        self.max_consecutive_failures = max_consecutive_failures
        self.retry_after_s = retry_after_s
        self.consecutive_failures = 0
        self.num_failed_steps = 0
        self.last_error: str | None = None
        self.last_failure_s: float | None = None

    def record_ok(self) -> None:
        self.consecutive_failures = 0

    def record_failure(self, exc: BaseException, now_s: float) -> None:
        self.consecutive_failures += 1
        self.num_failed_steps += 1
        self.last_error = repr(exc)
        self.last_failure_s = now_s

    def healthy(self, now_s: float) -> bool:
        return self.consecutive_failures < self.max_consecutive_failures

    def probe_due(self, now_s: float) -> bool:
        """Whether an idle engine should be probed now: its last step or probe failed, at least
        ``retry_after_s`` ago."""
        return (self.consecutive_failures > 0 and self.last_failure_s is not None
                and now_s - self.last_failure_s >= self.retry_after_s)

    def report(self, now_s: float) -> dict:
        """``{"healthy", "consecutive_failed_steps", "num_failed_steps", "last_error"}``."""
        return {"healthy": self.healthy(now_s), "consecutive_failed_steps": self.consecutive_failures,
                "num_failed_steps": self.num_failed_steps, "last_error": self.last_error}


class DuplicateRequestId(ValueError):
    """A request id that is already in flight on this worker (the caller answers 409)."""


class HandlerFirstLock:
    """The engine lock (:attr:`EngineRunner.engine_lock`): the engine thread holds it for each step,
    handlers (``with lock:``) take it between steps, and a waiting handler goes first. A plain
    ``threading.Lock`` is not fair: the engine thread releases it and takes it again at once for
    its next step, so a handler waiting for it (a decode import, a KV snapshot) could wait many
    steps. Here the engine thread does not start a step while a handler waits (for at most
    ``max_defer_s`` at a time, so that a stream of handlers cannot stop the engine)."""

    def __init__(self, max_defer_s: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition()
        self._waiting = 0
        self.max_defer_s = max_defer_s

    def __enter__(self) -> "HandlerFirstLock":
        with self._cv:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cv:
                self._waiting -= 1
                self._cv.notify_all()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def acquire_for_step(self) -> None:
        """The engine thread: wait until no handler waits (bounded), then take the lock."""
        with self._cv:
            self._cv.wait_for(lambda: self._waiting == 0, timeout=self.max_defer_s)
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()


class EngineRunner:
    """Runs ``engine.step()`` in a dedicated thread while there is work."""

    def __init__(self, engine, publisher: EventPublisher | None, health: StepHealth | None = None,
                 max_step_s: float = 120.0):
        self.engine = engine
        self.max_step_s = max_step_s
        self._step_started_s: float | None = None  # monotonic start of the step running now
        self.publisher = publisher
        self.engine_lock = HandlerFirstLock()
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.num_steps = 0
        self.step_health = health or StepHealth()
        # on the engine thread, under engine_lock, for each output with finish_reason "handoff":
        # stage that request's KV (see the module docstring; installed by a worker with a handoff sender)
        self.stage_handoff: Callable[[str], Any] | None = None
        self.release_staged: Callable[[str, Any], None] | None = None  # undo one for a request nobody waits for
        self._staged: dict[str, concurrent.futures.Future] = {}  # request id -> stage_handoff's outcome
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

    def current_step_s(self, now_s: float | None = None) -> float:
        """Seconds the engine's current step has run (0.0 when no step runs)."""
        started = self._step_started_s
        return 0.0 if started is None else (time.monotonic() if now_s is None else now_s) - started

    def stuck(self, now_s: float | None = None) -> bool:
        """Whether the engine cannot make progress: its current step has run longer than
        ``max_step_s``, or its thread is gone while the runner was not closed (any thread may ask)."""
        gone = not self._thread.is_alive() and not self._stop.is_set()
        return gone or self.current_step_s(now_s) > self.max_step_s

    def health(self) -> dict:
        """The worker's current health: :class:`StepHealth`'s report, unhealthy also while the
        engine is stuck (``stuck``, ``current_step_s``)."""
        now = time.monotonic()
        report = self.step_health.report(now)
        stuck = self.stuck(now)
        report.update(healthy=report["healthy"] and not stuck, stuck=stuck,
                      current_step_s=round(self.current_step_s(now), 3),
                      num_failed_requests=getattr(self.engine, "num_failed_requests", 0))
        return report

    def open_stream(self, request_id: str) -> RequestStream:
        """The output stream of a new request.

        Raises:
            DuplicateRequestId: a request with this id is in flight here (replacing its stream
                would cut it off from its outputs)."""
        s = RequestStream(asyncio.Queue(), asyncio.get_running_loop())
        with self._streams_lock:
            if request_id in self._streams:
                raise DuplicateRequestId(f"request id {request_id!r} is already in flight on this worker")
            self._streams[request_id] = s
        return s

    def in_flight(self, request_id: str) -> bool:
        with self._streams_lock:
            return request_id in self._streams

    def close_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)
            self._staged.pop(request_id, None)

    def take_staged(self, request_id: str) -> concurrent.futures.Future | None:
        """The outcome of the engine thread's staging of ``request_id`` (None: not staged there)."""
        with self._streams_lock:
            return self._staged.pop(request_id, None)

    def _stage_handoffs(self, outputs) -> None:
        """Engine thread, under engine_lock: stage every handoff among ``outputs`` whose stream is
        open. A stream closed meanwhile (its handler dropped the request: ``abort`` closes the
        stream before the handler releases the staging) gets nothing staged, or what was staged is
        released at once, so that nothing outlives the request."""
        stage = self.stage_handoff
        assert stage is not None  # the loop calls this only on a worker that stages handoffs
        for out in outputs:
            if out.finish_reason != "handoff" or not self.in_flight(out.request_id):
                continue
            fut: concurrent.futures.Future = concurrent.futures.Future()
            try:
                fut.set_result(stage(out.request_id))
            except Exception as e:  # the handler answers it as an error of this request only
                fut.set_exception(e)
            with self._streams_lock:
                if out.request_id in self._streams:
                    self._staged[out.request_id] = fut
                    continue
            if fut.exception() is None and self.release_staged is not None:
                self.release_staged(out.request_id, fut.result())

    def submit(self, engine_request) -> RequestStream:
        """Register a stream and add the request to the engine."""
        s = self.open_stream(engine_request.request_id)
        try:
            self.engine.add_request(engine_request)
        except BaseException:
            self.close_stream(engine_request.request_id)
            raise
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
                self._probe_if_due()
                if self.publisher is not None:
                    self.publisher.flush()
                continue
            try:
                self.engine_lock.acquire_for_step()
                try:
                    self._step_started_s = time.monotonic()
                    try:
                        outputs = self.engine.step()
                    finally:
                        self._step_started_s = None
                    step_error = getattr(self.engine, "last_step_error", None)
                    if self.stage_handoff is not None:
                        self._stage_handoffs(outputs)
                finally:
                    self.engine_lock.release()
            except BaseException as e:  # an engine bug outside its own isolation: fail every waiter, never hang
                self.step_health.record_failure(e, time.monotonic())
                self._fail_all(e)
                continue
            self.num_steps += 1
            if step_error is None:
                self.step_health.record_ok()
            else:
                self.step_health.record_failure(step_error, time.monotonic())
            try:
                if self.publisher is not None:
                    self.publisher.flush()
                self._deliver(outputs)
            except Exception as e:  # a bug after the step: fail the waiters, but the thread lives on
                self.step_health.record_failure(e, time.monotonic())
                self._fail_all(e)

    def _probe_if_due(self) -> None:
        """Idle, with the last step or probe failed long enough ago: run the engine's canary
        forward (:meth:`cpd.engine.engine.Engine.probe`) and record it like a step, so that a
        broken engine stays unhealthy (and its count grows to the supervisor's restart limit)
        and a healthy one comes back, without a client's request as the probe. An engine with
        no free block cannot probe: nothing is recorded."""
        if not self.step_health.probe_due(time.monotonic()):
            return
        self.engine_lock.acquire_for_step()
        try:
            self._step_started_s = time.monotonic()
            error = self.engine.probe()
        except NoFreeBlocks:
            return
        except BaseException as e:
            error = e
        finally:
            self._step_started_s = None
            self.engine_lock.release()
        if error is None:
            self.step_health.record_ok()
        else:
            self.step_health.record_failure(error, time.monotonic())

    def _put(self, request_id: str, s: RequestStream, item) -> None:
        """Hand ``item`` to the stream's loop; a stream whose loop has closed (nobody will ever
        read it) has its request aborted instead, so that its blocks are freed."""
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            self.abort(request_id)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            with self._streams_lock:
                s = self._streams.get(out.request_id)
            if s is None:
                continue
            item = out
            if out.finish_reason == "error":
                item = RequestFailed(getattr(out, "error", None) or "request failed in the engine",
                                     engine_failed=getattr(out, "engine_failed", False))
            self._put(out.request_id, s, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.items())
        for rid, s in streams:
            self.engine.abort(rid)
            self._put(rid, s, exc)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
