"""The worker's engine lock lets a waiting handler in before the engine's next step
(cpd.worker.runtime.HandlerFirstLock): real threads, an engine loop that steps back to back."""
from __future__ import annotations

import threading
import time

from cpd.worker.runtime import HandlerFirstLock

STEP_S = 0.05


def _engine_loop(lock: HandlerFirstLock, stop: threading.Event, steps: list[float]) -> None:
    while not stop.is_set():
        lock.acquire_for_step()
        try:
            time.sleep(STEP_S)  # a step: the lock is held throughout
            steps.append(time.monotonic())
        finally:
            lock.release()


def test_a_waiting_handler_gets_the_lock_within_one_step():
    lock, stop, steps = HandlerFirstLock(), threading.Event(), []
    engine = threading.Thread(target=_engine_loop, args=(lock, stop, steps))
    engine.start()
    try:
        waits, steps_waited = [], []
        for _ in range(20):
            time.sleep(STEP_S * 0.37)  # arrive somewhere inside a step
            t, n0 = time.monotonic(), len(steps)
            with lock:
                waits.append(time.monotonic() - t)
                steps_waited.append(len(steps) - n0)
                n_before = len(steps)
                time.sleep(0.01)
                assert len(steps) == n_before  # no step runs while the handler holds it
        # at most the rest of the running step (plus scheduling slack on a loaded machine)
        assert max(waits) < 3 * STEP_S, waits
        # only the step running when it arrived ends before it (a plain Lock: the engine thread,
        # retaking it at once, ran one more step first in every try here)
        assert max(steps_waited) <= 1, steps_waited
    finally:
        stop.set()
        engine.join(5)
    assert len(steps) > 10  # the engine kept stepping between the handlers


def test_a_stream_of_handlers_does_not_stop_the_engine():
    lock, stop, steps = HandlerFirstLock(max_defer_s=0.1), threading.Event(), []
    busy = threading.Event()

    def handlers():
        while not busy.is_set():
            with lock:
                time.sleep(0.005)

    hs = [threading.Thread(target=handlers) for _ in range(3)]
    engine = threading.Thread(target=_engine_loop, args=(lock, stop, steps))
    for h in hs:
        h.start()
    engine.start()
    time.sleep(1.5)
    busy.set()
    stop.set()
    for h in hs:
        h.join(5)
    engine.join(5)
    assert len(steps) >= 3, steps  # at least one step per max_defer_s (and its own length), give or take
