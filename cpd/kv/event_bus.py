"""Transport of KV events: ZMQ PUB on each worker, SUB in the router.

Wire format is vLLM's (see :mod:`cpd.kv.events`): multipart ``[topic, seq, payload]``.
The publisher owns its socket in one thread (ZMQ sockets are not thread-safe); any
thread may :meth:`EventPublisher.emit`. Events are batched per :meth:`flush` call
(the worker flushes after every engine step, and its L3 writer after every write-through:
:class:`cpd.store.connector.L3Connector` ``on_written``).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import msgspec
import zmq

from cpd.kv.events import KVCacheEvent, decode_batch, encode_batch, pack_seq, unpack_seq

TOPIC = b"kv-events"


class EventPublisher:
    """Batches events and publishes them on ``tcp://host:port`` (ZMQ PUB).

    Attributes:
        seq: sequence number of the last published batch (-1 before the first).
    """

    def __init__(self, endpoint: str):
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pending: list[KVCacheEvent] = []
        self._lock = threading.Lock()
        self._q: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self.seq = -1
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-event-pub", daemon=True)
        self._thread.start()

    def emit(self, event: KVCacheEvent) -> None:
        """Queue one event for the next batch (thread-safe)."""
        with self._lock:
            self._pending.append(event)

    def flush(self) -> int:
        """Publish pending events as one batch; returns the batch's seq (or current seq if none)."""
        with self._lock:
            if not self._pending:
                return self.seq
            events, self._pending = self._pending, []
            self.seq += 1
            self._q.put((self.seq, encode_batch(events)))
            return self.seq

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                break
            seq, payload = item
            self._sock.send_multipart([TOPIC, pack_seq(seq), payload])
        self._sock.close(0)

    def close(self) -> None:
        self.flush()
        self._q.put(None)
        self._thread.join(timeout=2)


class EventSubscriber:
    """Subscribes to many publishers and calls ``on_batch(worker_id, seq, batch)``
    from its own thread. Endpoints can be added while running.

    ``decode(payload)`` turns a batch's payload into the object ``on_batch`` gets (default
    :func:`cpd.kv.events.decode_batch`; the router's index: :func:`cpd.kv.events.decode_batch_for_index`).

    ``on_iteration()`` (optional) is called once per poll round, at most ~50 ms apart while the
    loop runs (a liveness tick; it may raise to end the loop). ``runner(body, stop)`` (optional)
    runs the loop in the thread: ``body()`` returns once ``stop`` is set (:meth:`close`) and raises when the
    loop dies (an exception in ``on_batch`` or ``on_iteration``); a runner may call ``body()``
    again to restart it, with fresh sockets to every endpoint added so far
    (:meth:`cpd.router.background.BackgroundTasks.run_thread`). Without one, a death ends the
    thread (and is reported by :func:`threading.excepthook`)."""

    def __init__(self, on_batch: Callable[[str, int, object], None],
                 on_iteration: Callable[[], None] | None = None,
                 runner: Callable[[Callable[[], None], threading.Event], None] | None = None,
                 decode: Callable[[bytes], object] = decode_batch):
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._on_batch = on_batch
        self._on_iteration = on_iteration
        self._decode = decode
        self._endpoints: dict[str, str] = {}
        self._lock = threading.Lock()
        self._add_q: queue.Queue[tuple[str, str]] = queue.Queue()
        self._stop = threading.Event()
        self.num_decode_errors = 0
        run = runner or (lambda body, stop: body())
        self._thread = threading.Thread(target=run, args=(self._run, self._stop), name="kv-event-sub", daemon=True)
        self._thread.start()

    def add(self, worker_id: str, endpoint: str) -> None:
        with self._lock:
            self._endpoints[worker_id] = endpoint
            self._add_q.put((worker_id, endpoint))

    def _run(self) -> None:
        socks: dict[zmq.Socket[bytes], str] = {}
        poller = zmq.Poller()

        def connect(wid: str, ep: str) -> None:
            s = self._ctx.socket(zmq.SUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, TOPIC)
            s.connect(ep)
            socks[s] = wid
            poller.register(s, zmq.POLLIN)

        try:
            with self._lock:  # a (re)start: every endpoint known so far, once
                while not self._add_q.empty():
                    self._add_q.get()
                for wid, ep in self._endpoints.items():
                    connect(wid, ep)
            while not self._stop.is_set():
                if self._on_iteration is not None:
                    self._on_iteration()
                while not self._add_q.empty():
                    connect(*self._add_q.get())
                for s, _ in poller.poll(50):
                    topic, seq, payload = s.recv_multipart()
                    try:
                        batch = self._decode(payload)
                    except msgspec.DecodeError:
                        self.num_decode_errors += 1
                        continue
                    self._on_batch(socks[s], unpack_seq(seq), batch)
        finally:
            for s in socks:
                s.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
