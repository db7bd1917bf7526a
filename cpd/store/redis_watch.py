"""Redis's own evictions/expirations -> ``BlockRemoved(medium="L3")`` (keyspace notifications).

When the server runs with ``maxmemory`` and an eviction policy, it drops keys on its own; the
router would only learn of that as stale hits on load. :class:`EvictionWatcher` subscribes to
the ``evicted`` and ``expired`` key-event channels of every node (one thread per node: keyspace
notifications are node-local in a cluster), turning the notification on first with
``CONFIG SET notify-keyspace-events`` (flags ``E``, ``x``, ``e`` merged with the current ones;
if ``CONFIG`` is disabled the server must already be configured). Each chunk key reported is
handed to :meth:`RedisStore.on_server_removed`. Disconnects are retried every
``retry_s`` seconds; notifications sent while disconnected are lost (Redis pub/sub is not durable).
"""
from __future__ import annotations

import logging
import threading

import redis

log = logging.getLogger("cpd.store.watch")

NOTIFY_FLAGS = "Exe"


def enable_notifications(r: redis.Redis) -> str:
    """Merge ``E``, ``x``, ``e`` into the server's ``notify-keyspace-events``; returns the new value."""
    raw = r.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
    cur: str = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    have = set(cur) | (set("g$lshzxetd") if "A" in cur else set())
    if set(NOTIFY_FLAGS) <= have:
        return cur
    want = "".join(sorted(set(cur) | set(NOTIFY_FLAGS)))
    r.config_set("notify-keyspace-events", want)
    return want


class EvictionWatcher:
    """Background threads listening for a store's server-side evictions.

    Args:
        store: a :class:`~cpd.store.redis_store.RedisStore` (or cluster store).
        retry_s: pause between reconnection attempts.
    Attributes:
        seen: chunk keys reported so far (counter).
        ready: set once every node's subscription is active (for tests/startup).
    """

    def __init__(self, store, retry_s: float = 0.5):
        self.store = store
        self.retry_s = retry_s
        self.seen = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ready: list[threading.Event] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        nodes = self.store._watch_nodes()
        for host, port in nodes:
            ev = threading.Event()
            t = threading.Thread(target=self._run, args=(host, port, ev), daemon=True,
                                 name=f"l3-evict-watch-{port}")
            self._ready.append(ev)
            self._threads.append(t)
            t.start()

    def wait_ready(self, timeout_s: float = 5.0) -> bool:
        return all(e.wait(timeout_s) for e in self._ready)

    def _run(self, host: str, port: int, ready: threading.Event) -> None:
        db = getattr(self.store, "db", 0) or 0
        chans = [f"__keyevent@{db}__:evicted", f"__keyevent@{db}__:expired"]
        to = max(self.store.timeout_s, 0.1)
        while not self._stop.is_set():
            r = ps = None
            try:
                r = redis.Redis(host=host, port=port, db=db, socket_timeout=to,
                                socket_connect_timeout=to, health_check_interval=0,
                                **getattr(self.store, "connection", {}))
                try:
                    enable_notifications(r)
                except redis.ResponseError as e:  # CONFIG disabled: assume it is configured
                    log.warning("cannot enable keyspace notifications on %s:%s: %s", host, port, e)
                ps = r.pubsub(ignore_subscribe_messages=True)
                ps.subscribe(*chans)
                ready.set()
                while not self._stop.is_set():
                    try:
                        msg = ps.get_message(timeout=0.2)
                    except redis.TimeoutError:
                        continue
                    if msg and msg.get("type") == "message":
                        try:
                            if self.store.on_server_removed(msg["data"]):
                                with self._lock:
                                    self.seen += 1
                        except Exception:  # never kill the watcher
                            log.exception("eviction handler failed")
            except (redis.RedisError, OSError) as e:
                log.debug("watcher %s:%s disconnected: %r", host, port, e)
                self._stop.wait(self.retry_s)
            finally:
                for c in (ps, r):
                    try:
                        if c is not None:
                            c.close()
                    except Exception:
                        pass

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
