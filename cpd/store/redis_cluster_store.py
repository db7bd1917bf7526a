"""``redis+cluster://HOST:PORT[,HOST:PORT...]`` backend: Redis Cluster via redis-py's
``RedisCluster`` (hiredis parser).

Same semantics as :class:`~cpd.store.redis_store.RedisStore`, with keys laid out for hash slots:

* visible chunk ``<prefix>{<last_hash:016x>:<n>}``; its staging keys
  ``<prefix>stage:{<last_hash:016x>:<n>}:<uuid>`` carry the same hash tag, so the seal script
  (check length, rename-if-absent) runs on one node, atomically, first sealer wins;
* ``SET NX`` puts are grouped by owning node and written as raw pipelined RESP on that node's
  connection (one round trip per node, no payload copy); a ``MOVED``/``ASK`` reply (slots
  migrating) falls back to the cluster pipeline, which follows redirections;
* ``EXISTS``/``GET``/``DEL`` batches use the cluster pipeline (commands grouped per node, one
  round trip per node); Lua scripts are only ever called on keys of one slot;
* the bookkeeping keys (``{<prefix>meta}:lru|info|used``) share one hash tag (one node);
* ``SCAN`` visits every primary; the eviction watcher subscribes on every primary (keyspace
  notifications are node-local).

The client is created lazily (the first call contacts a seed node and loads the slot map), so
constructing a store never fails; redis-py's own retries are disabled so an unreachable
cluster raises :class:`~cpd.store.base.StoreUnavailable` quickly; after an error the slot map
is reloaded on the next call, so the store recovers when the nodes come back.
"""
from __future__ import annotations

import threading
import uuid

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterDownError, RedisClusterException, TryAgainError
from redis.retry import Retry

from cpd.store.base import ChunkKey, StoreUnavailable
from cpd.store.redis_resp import join_parts, set_nx_many
from cpd.store.redis_scripts import RedisScripts
from cpd.store.redis_store import RedisErrors, RedisStore


_REDIRECT = (AskError, TryAgainError, ClusterDownError)  # MovedError is an AskError


class RedisClusterStore(RedisStore):
    """Client of one Redis Cluster: a :class:`~cpd.store.redis_store.RedisStore` whose client
    side is replaced — the lazily created cluster client (:attr:`r`) and its scripts, the error
    guard that reloads the slot map, hash-tagged keys, per-node raw puts, SCAN and eviction
    watching on every primary. The protocol, bookkeeping and eviction are inherited unchanged.

    Args:
        nodes: seed ``(host, port)`` pairs.
        Others: as :class:`~cpd.store.redis_store.RedisStore` (no ``db``: a cluster has only db 0).
    """

    _errors = (redis.RedisError, OSError, RedisClusterException)

    def __init__(self, nodes: list[tuple[str, int]], **kw):
        self.nodes = [(h, int(p)) for h, p in nodes]
        super().__init__(self.nodes[0][0], self.nodes[0][1], 0, **kw)

    def _init_client(self, host: str, port: int, db: int) -> None:
        """No connection yet: the cluster client is created on first use (:attr:`r`)."""
        self.url = "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.nodes)
        self._rc: RedisCluster | None = None
        self._cluster_scripts: RedisScripts | None = None
        self._rc_lock = threading.Lock()
        self._broken = False

    @property
    def r(self) -> RedisCluster:
        """The cluster client (created on first use). Raises: StoreUnavailable."""
        rc = self._rc
        if rc is not None and not self._broken:
            return rc
        with self._rc_lock:
            if self._rc is None:
                with self._guard():
                    rc = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.nodes],
                                      socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                                      retry=Retry(NoBackoff(), 0), require_full_coverage=True,
                                      **self.connection)
                self._cluster_scripts = RedisScripts.register(rc)
                self._rc = rc
            elif self._broken:
                try:
                    with self._guard():
                        self._rc.nodes_manager.initialize()
                except StoreUnavailable:
                    raise
                self._broken = False
            assert self._rc is not None
            return self._rc

    def scripts(self) -> RedisScripts:
        """The Lua scripts, registered with the cluster client (created on first use; each
        script is only ever called on keys of one slot). Raises: StoreUnavailable."""
        self.r  # noqa: B018 - creates the client, which registers them
        assert self._cluster_scripts is not None
        return self._cluster_scripts

    def _guard(self) -> RedisErrors:
        return RedisErrors(self.url, self._errors, on_error=self._mark_broken)

    def _mark_broken(self) -> None:
        self._broken = True  # reload the slot map on the next call

    def _pipe(self):
        return self.r.pipeline()

    def _key(self, key: ChunkKey) -> str:
        return f"{self.prefix}{{{key[0]:016x}:{key[1]}}}"

    def _stage_key(self, key: ChunkKey) -> str:
        return f"{self.prefix}stage:{{{key[0]:016x}:{key[1]}}}:{uuid.uuid4().hex[:12]}"

    def ping(self) -> bool:
        with self._guard():
            return bool(self.r.ping(target_nodes=RedisCluster.ALL_NODES))

    def _put_many(self, items: list[tuple[ChunkKey, list]]) -> list[bool]:
        rc = self.r
        won = [False] * len(items)
        with self._guard():
            groups: dict[str, list[int]] = {}
            nodes = {}
            for i, (key, _) in enumerate(items):
                node = rc.get_node_from_key(self._key(key))
                groups.setdefault(node.name, []).append(i)
                nodes[node.name] = node
            redo: list[int] = []
            for name, idx in groups.items():
                conn = rc.get_redis_connection(nodes[name])
                replies = set_nx_many(conn.connection_pool,
                                           [(self._key(items[i][0]).encode(), items[i][1]) for i in idx],
                                           self.chunk_ttl_ms)
                for i, rep in zip(idx, replies):
                    if isinstance(rep, _REDIRECT):
                        redo.append(i)
                    elif isinstance(rep, Exception):
                        won[i] = False  # e.g. OOM (maxmemory, nothing evictable): dropped
                    else:
                        won[i] = rep is not None
            if redo:  # slots moved: let the cluster pipeline follow MOVED/ASK
                self._broken = True
                p = self.r.pipeline()
                for i in redo:
                    p.set(self._key(items[i][0]), bytes(join_parts(items[i][1])), nx=True,
                          px=self.chunk_ttl_ms or None)
                for i, rep in zip(redo, p.execute(raise_on_error=False)):
                    won[i] = rep is True
        if self.track:
            self.lru.after_write(self._written(items, won))
        return won

    def _scan_names(self, match: str) -> list:
        return list(self.r.scan_iter(match=match, count=1000))

    def _watch_nodes(self) -> list[tuple[str, int]]:
        with self._guard():
            return [(n.host, n.port) for n in self.r.get_primaries()]

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        rc, self._rc = self._rc, None
        if rc is not None:
            try:
                rc.close()
            except Exception:
                pass
