"""Prefill-side end of the handoff: stages arrays in the arena (or a private copy) and serves
them over TCP."""
from __future__ import annotations

import hmac
import itertools
import logging
import secrets
import socket
import threading
import time
from typing import Any, Callable

import numpy as np

from cpd.messages.handoff import HandoffHandle
from cpd.worker.handoff.arena import ALIGN, HDR_BYTES, REGION_HDR, REGION_MAGIC, Arena
from cpd.worker.handoff.errors import HandoffError
from cpd.worker.handoff.framing import REP, REQ, recv_exact
from cpd.worker.handoff.payload import as_numpy, bytes_view, host_identity, payload_checksum


class _Entry:
    """One staging. ``offset`` is the region start (shm: header, then payload at +64)."""

    __slots__ = ("kind", "offset", "nbytes", "array", "t", "sending", "released", "generation", "checksum")

    def __init__(self, kind, offset, nbytes, array, generation, checksum):
        self.kind, self.offset, self.nbytes, self.array = kind, offset, nbytes, array
        self.generation, self.checksum = generation, checksum
        self.t = time.monotonic()
        self.sending = 0
        self.released = False


class HandoffSender:
    """Prefill-side end: stages arrays and serves them over shared memory or TCP.

    Args:
        arena_bytes: size of the preallocated shared-memory arena (bytes); 0 disables shm.
        bind_host: address the TCP server binds to (``"0.0.0.0"`` for cross-host).
        port: TCP port (0 = ephemeral).
        advertise_host: address put in handles (default: ``bind_host``, or this host's name
            when binding to all interfaces).
        reclaim_after_s: staged entries never released are freed after this many seconds.
        arena_prefix: file-name prefix of the arena under /dev/shm.
        secret: shared internal secret (:mod:`cpd.auth`); when set, each TCP connection must
            answer a challenge (:func:`cpd.auth.handoff_proof`) before it is served.
    """

    def __init__(self, arena_bytes: int = 256 << 20, bind_host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, reclaim_after_s: float = 120.0,
                 arena_prefix: str = "cpd-handoff", secret: bytes | None = None):
        self.secret = secret
        self.host_id = host_identity()
        self.reclaim_after_s = float(reclaim_after_s)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._arena = Arena(arena_bytes, arena_prefix) if arena_bytes > 0 else None
        self._st = {"staged_shm": 0, "staged_tcp": 0, "arena_full_fallbacks": 0, "released": 0,
                    "reclaimed": 0, "tcp_served": 0, "tcp_bytes_sent": 0}
        self._srv = socket.create_server((bind_host, port), reuse_port=False)
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        if advertise_host is None:
            advertise_host = socket.gethostname() if bind_host in ("0.0.0.0", "", "::") else bind_host
        self.host = advertise_host
        self._closed = False
        self._generations = itertools.count(secrets.randbits(48) + 1)  # unique per sender, never 0
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, name="handoff-srv", daemon=True)
        self._thread.start()

    @property
    def arena_name(self) -> str | None:
        return self._arena.path if self._arena else None

    # ---- staging ----------------------------------------------------------------------------
    def stage(self, request_id: str, array: Any, meta: dict | None = None,
              force_tcp: bool = False) -> HandoffHandle:
        """Copy ``array`` (any shape/dtype; made C-contiguous) for pickup and return its handle.
        See :meth:`stage_into`.
        Raises:
            ValueError: ``request_id`` already staged and not released.
        """
        a = np.ascontiguousarray(as_numpy(array))
        return self.stage_into(request_id, a.shape, a.dtype, lambda out: np.copyto(out, a), meta, force_tcp)

    def stage_into(self, request_id: str, shape: tuple[int, ...], dtype: Any,
                   fill: Callable[[np.ndarray], Any], meta: dict | None = None,
                   force_tcp: bool = False) -> HandoffHandle:
        """Stage a ``shape``/``dtype`` array that ``fill(out)`` writes straight into its staging
        area (the shm arena region, or a private buffer for TCP) — the producer's one copy is
        the only one. Uses the arena if there is room (after reclaiming expired entries), else
        TCP. The handle carries a fresh generation and the payload checksum (module docstring).
        Raises:
            ValueError: ``request_id`` already staged and not released.
            Whatever ``fill`` raises (the staging area is freed first).
        """
        dt = np.dtype(dtype)
        rid = str(request_id)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        self.reclaim()
        off, generation = self._reserve(rid, nbytes, force_tcp)
        # fill outside the lock; the entry becomes servable only once complete
        if off is not None:
            self._write_region_header(off, 0, nbytes, 0)  # seqlock: invalid while being written
            p = off + HDR_BYTES
            out = self._shm_arena.buf[p:p + nbytes].view(dt).reshape(shape)
        else:
            out = np.empty(shape, dtype=dt)
        try:
            if nbytes:
                fill(out)
        except BaseException:
            if off is not None:
                with self._lock:
                    self._free(_Entry("shm", off, nbytes, None, generation, 0))
            raise
        checksum = payload_checksum(bytes_view(out))
        if off is not None:
            self._write_region_header(off, generation, nbytes, checksum)
            ent = _Entry("shm", off, nbytes, None, generation, checksum)
        else:
            ent = _Entry("tcp", 0, nbytes, out, generation, checksum)
        self._publish(rid, ent)
        arena = self._shm_arena if off is not None else None
        return HandoffHandle(kind=ent.kind, host=self.host, port=self.port, request_id=rid, nbytes=nbytes,
                             dtype=dt.str, shape=tuple(int(x) for x in shape), host_id=self.host_id,
                             generation=generation, checksum=checksum, reclaim_after_s=self.reclaim_after_s,
                             meta=meta or {}, name=arena.path if arena else None,
                             arena_id=arena.arena_id if arena else None,
                             offset=off + HDR_BYTES if off is not None else None)

    def _reserve(self, rid: str, nbytes: int, force_tcp: bool) -> tuple[int | None, int]:
        """An arena region (``None``: TCP) and a fresh generation for a new staging of ``rid``."""
        with self._lock:
            if self._closed:
                raise HandoffError("sender closed")
            if rid in self._entries:
                raise ValueError(f"request {rid!r} already staged")
            off = None
            if self._arena is not None and not force_tcp:
                off = self._arena.alloc(HDR_BYTES + nbytes)
                if off is None:
                    self._st["arena_full_fallbacks"] += 1
            return off, next(self._generations)

    def _publish(self, rid: str, ent: "_Entry") -> None:
        """Make a complete staging servable (or free it if the id was taken or the sender closed)."""
        with self._lock:
            if self._closed or rid in self._entries:
                self._free(ent)
                raise ValueError(f"request {rid!r} already staged") if not self._closed else HandoffError("sender closed")
            self._entries[rid] = ent
            self._st["staged_shm" if ent.kind == "shm" else "staged_tcp"] += 1

    @property
    def _shm_arena(self) -> Arena:
        """The arena, for shm stagings (which exist only when there is one)."""
        assert self._arena is not None
        return self._arena

    def _write_region_header(self, off: int, generation: int, nbytes: int, checksum: int) -> None:
        hdr = REGION_HDR.pack(REGION_MAGIC, generation, nbytes, checksum)
        self._shm_arena.buf[off:off + len(hdr)] = np.frombuffer(hdr, dtype=np.uint8)

    def is_staged(self, request_id: str) -> bool:
        """Whether ``request_id`` has a staging not yet released (or reclaimed)."""
        with self._lock:
            return str(request_id) in self._entries

    def release(self, request_id: str, generation: int | None = None) -> bool:
        """Free the request's staged data. Returns False if unknown (already released/reclaimed)
        or if ``generation`` is given and names another staging of the same id (a late release
        never frees a newer staging). A TCP transfer in progress finishes first; the space is
        freed after it."""
        rid = str(request_id)
        with self._lock:
            ent = self._entries.get(rid)
            if ent is None or (generation is not None and int(generation) != ent.generation):
                return False
            del self._entries[rid]
            ent.released = True
            self._st["released"] += 1
            if ent.sending == 0:
                self._free(ent)
            return True

    def _free(self, ent: _Entry) -> None:  # lock held
        if ent.kind == "shm" and self._arena is not None:
            self._write_region_header(ent.offset, 0, 0, 0)  # any reader of this region now fails
            self._arena.dealloc(ent.offset, HDR_BYTES + ent.nbytes)
        ent.array = None

    def reclaim(self, max_age_s: float | None = None) -> int:
        """Free entries staged more than ``max_age_s`` (default ``reclaim_after_s``) ago."""
        age = self.reclaim_after_s if max_age_s is None else max_age_s
        cutoff = time.monotonic() - age
        n = 0
        with self._lock:
            for rid in [r for r, e in self._entries.items() if e.t <= cutoff]:
                ent = self._entries.pop(rid)
                ent.released = True
                if ent.sending == 0:
                    self._free(ent)
                n += 1
            self._st["reclaimed"] += n
        return n

    def stats(self) -> dict:
        """``bytes_staged``, ``num_staged``, ``arena_bytes``, ``arena_free_bytes`` and counters
        (``staged_shm``, ``staged_tcp``, ``arena_full_fallbacks``, ``released``, ``reclaimed``,
        ``tcp_served``, ``tcp_bytes_sent``)."""
        with self._lock:
            return {**self._st, "bytes_staged": sum(e.nbytes for e in self._entries.values()),
                    "num_staged": len(self._entries), "tcp_port": self.port,
                    "tcp_refused": self._st.get("tcp_refused", 0),
                    "arena_bytes": self._arena.size - ALIGN if self._arena else 0,
                    "arena_free_bytes": self._arena.free_bytes() if self._arena else 0}

    # ---- TCP server ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="handoff-conn").start()

    def _challenge(self, conn: socket.socket) -> bool:
        """With a secret: send a nonce, expect its proof; False (logged) if the peer fails."""
        from cpd.auth import HANDOFF_NONCE_BYTES, HANDOFF_PROOF_BYTES, handoff_proof
        nonce = secrets.token_bytes(HANDOFF_NONCE_BYTES)
        conn.sendall(nonce)
        proof = bytearray(HANDOFF_PROOF_BYTES)
        recv_exact(conn, memoryview(proof))
        assert self.secret is not None  # challenged only with a secret
        if hmac.compare_digest(bytes(proof), handoff_proof(self.secret, nonce)):
            return True
        self._st["tcp_refused"] = self._st.get("tcp_refused", 0) + 1
        logging.getLogger("cpd.handoff").warning("refused a handoff connection from %s: wrong secret",
                                                 conn.getpeername())
        return False

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.secret and not self._challenge(conn):
                return
            hdr = bytearray(REQ.size)
            while True:
                try:
                    recv_exact(conn, memoryview(hdr))
                except (ConnectionError, OSError):
                    return
                ln, generation = REQ.unpack(hdr)
                rid_b = bytearray(ln)
                recv_exact(conn, memoryview(rid_b))
                rid = rid_b.decode()
                with self._lock:
                    ent = self._entries.get(rid)
                    if ent is not None and ent.generation != generation:
                        ent = None  # the id was restaged: this handle names an older staging
                    if ent is not None:
                        ent.sending += 1
                        # counted before sending: a receiver that has the bytes always sees it
                        self._st["tcp_served"] += 1
                if ent is None:
                    conn.sendall(REP.pack(1, 0))
                    continue
                try:
                    if ent.kind == "shm":
                        p = ent.offset + HDR_BYTES
                        view = memoryview(self._shm_arena.mm)[p:p + ent.nbytes]
                    else:
                        view = bytes_view(ent.array)
                    conn.sendall(REP.pack(0, ent.nbytes))
                    conn.sendall(view)
                    del view
                finally:
                    with self._lock:
                        ent.sending -= 1
                        self._st["tcp_bytes_sent"] += ent.nbytes
                        if ent.released and ent.sending == 0:
                            self._free(ent)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop the server, drop all staged data and unlink the arena (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            self._entries.clear()
        try:
            self._srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._srv.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(2.0)
        if self._arena is not None:
            self._arena.close()

    def __enter__(self) -> "HandoffSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
