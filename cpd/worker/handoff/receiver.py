"""Decode-side end of the handoff: fetches a staged array by handle (shared memory on the same
host, TCP otherwise) and verifies that it is that staging."""
from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections import OrderedDict

import numpy as np

from cpd.messages.handoff import HandoffHandle
from cpd.worker.handoff.arena import ALIGN, ARENA_MAGIC, HDR_BYTES, REGION_HDR, REGION_MAGIC
from cpd.worker.handoff.errors import HandoffError, HandoffStaleError
from cpd.worker.handoff.framing import REP, REQ, recv_exact, time_left
from cpd.worker.handoff.payload import as_handle, bytes_view, handle_layout, host_identity, payload_checksum


class HandoffReceiver:
    """Decode-side end: fetches staged arrays by handle.

    Args:
        force_tcp: never use shared memory (tests, or hosts without a shared /dev/shm).
        timeout_s: TCP connect/read timeout (seconds).
        secret: shared internal secret; answers the sender's TCP challenge (:mod:`cpd.auth`).
    """

    def __init__(self, force_tcp: bool = False, timeout_s: float = 10.0, secret: bytes | None = None,
                 max_arenas: int = 16):
        self.secret = secret
        self.force_tcp = force_tcp
        self.timeout_s = timeout_s
        self.max_arenas = max(1, int(max_arenas))
        self.host_id = host_identity()
        # sender arenas mapped here, least recently used first: a mapping keeps a dead sender's
        # memfd alive, so maps of senders that are gone are dropped and at most max_arenas are kept
        self._maps: OrderedDict[tuple[str, str | None], mmap.mmap] = OrderedDict()
        self._map_files: dict[tuple[str, str | None], tuple[int, int]] = {}  # key -> (st_dev, st_ino)
        self._socks: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()
        self._st = {"fetched_shm": 0, "fetched_tcp": 0, "viewed_shm": 0, "bytes_fetched": 0, "stale_detected": 0}

    def path_for(self, handle: HandoffHandle | dict) -> str:
        """``"shm"`` or ``"tcp"``: the path :meth:`fetch` will take for this handle."""
        handle = as_handle(handle)
        if handle.kind == "shm" and not self.force_tcp and handle.host_id == self.host_id:
            return "shm"
        return "tcp"

    def fetch(self, handle: HandoffHandle | dict, out: np.ndarray | None = None,
              timeout_s: float | None = None) -> np.ndarray:
        """Copy the staged array out of the sender and verify that it is that staging.

        Args:
            handle: as returned by :meth:`HandoffSender.stage` (a JSON-decoded dict is converted).
            out: optional preallocated C-contiguous destination of the right dtype/shape.
            timeout_s: a bound on the whole TCP fetch (connect, challenge, every read and the
                retry on a stale cached connection together); without it each socket operation
                is bounded by the receiver's ``timeout_s`` alone. A stopped or partitioned sender
                then fails the fetch within the caller's bound (:class:`HandoffError`), not
                after two 10 s socket timeouts.
        Returns:
            A new array (or ``out``) with the handle's dtype and shape, checked against the
            handle's generation (shm header before and after the copy) and checksum.
        Raises:
            HandoffStaleError: the staging was released, reclaimed or restaged (never foreign data).
            HandoffError: sender unreachable, arena missing, bad handle.
        """
        handle = as_handle(handle)
        dtype, shape, nbytes = handle_layout(handle)
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.dtype != dtype or out.shape != shape or not out.flags.c_contiguous:
            raise HandoffError("out has the wrong dtype/shape/layout")
        if out.nbytes != nbytes:
            raise HandoffError("handle nbytes does not match dtype/shape")
        if self.path_for(handle) == "shm":
            mm, off = self._region(handle, nbytes)
            gen = handle.generation
            self._check_generation(mm, off, gen)
            if nbytes:
                np.copyto(out.reshape(-1).view(np.uint8),
                          np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=off))
            self._check_generation(mm, off, gen)  # not reclaimed or rewritten during the copy
            kind = "fetched_shm"
        else:
            self._fetch_tcp(handle, out, None if timeout_s is None else time.monotonic() + timeout_s)
            kind = "fetched_tcp"
        if payload_checksum(bytes_view(out)) != handle.checksum:
            with self._lock:
                self._st["stale_detected"] += 1
            raise HandoffStaleError(f"checksum mismatch for {handle.request_id!r}: not the staged payload")
        with self._lock:
            self._st[kind] += 1
            self._st["bytes_fetched"] += nbytes
        return out

    def view(self, handle: HandoffHandle | dict) -> np.ndarray:
        """Zero-copy, read-only view of a staged array when it lies in a shared-memory arena
        on this host; otherwise (TCP path) a verified fetched copy. The view is checked to be
        this staging when returned, but NOT afterwards: the sender may reclaim and restage the
        region while the caller reads it. Call :meth:`verify_view` after consuming it (or use
        :meth:`fetch`, which verifies its own copy).

        Raises:
            HandoffError: as :meth:`fetch`.
        """
        handle = as_handle(handle)
        if self.path_for(handle) != "shm":
            return self.fetch(handle)
        dtype, shape, nbytes = handle_layout(handle)
        mm, off = self._region(handle, nbytes)
        self._check_generation(mm, off, handle.generation)
        arr = np.frombuffer(mm, dtype=dtype, count=int(np.prod(shape)), offset=off).reshape(shape)
        with self._lock:
            self._st["viewed_shm"] += 1
            self._st["bytes_fetched"] += nbytes
        return arr

    def verify_view(self, handle: HandoffHandle | dict, arr: np.ndarray) -> None:
        """After the data of :meth:`view` was consumed: raise :class:`HandoffStaleError` unless
        the region still holds this staging and its bytes match the checksum."""
        handle = as_handle(handle)
        if self.path_for(handle) == "shm":
            mm, off = self._region(handle, handle.nbytes)
            self._check_generation(mm, off, handle.generation)
        if payload_checksum(bytes_view(np.ascontiguousarray(arr))) != handle.checksum:
            raise HandoffStaleError("checksum mismatch after consuming the view")

    def _region(self, handle: HandoffHandle, nbytes: int) -> tuple[mmap.mmap, int]:
        """The mapped arena and payload offset of an shm handle (bounds checked)."""
        if handle.name is None or handle.offset is None:
            raise HandoffError("bad handle: an shm handle needs name and offset")
        try:
            mm = self._map(handle.name, handle.arena_id)
        except OSError as e:
            raise HandoffError(f"cannot map arena {handle.name!r}: {e}") from e
        off = handle.offset
        if off < ALIGN + HDR_BYTES or off + nbytes > len(mm):
            raise HandoffError("handle outside the arena")
        return mm, off

    def _check_generation(self, mm: mmap.mmap, off: int, generation: int) -> None:
        magic, gen, _, _ = REGION_HDR.unpack_from(mm, off - HDR_BYTES)
        if magic != REGION_MAGIC or gen != generation:
            with self._lock:
                self._st["stale_detected"] += 1
            raise HandoffStaleError(f"staging generation {generation} is gone (region now holds {gen})")

    def _map(self, path: str, arena_id: str | None = None) -> mmap.mmap:
        """Map (once) the sender's arena; check its header against ``arena_id``."""
        key = (path, arena_id)
        with self._lock:
            mm = self._maps.get(key)
            if mm is not None:
                self._maps.move_to_end(key)
            else:
                self._prune_maps_locked()
                fd = os.open(path, os.O_RDONLY)
                try:
                    st = os.fstat(fd)
                    size = st.st_size
                    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                if arena_id is not None and mm[:len(ARENA_MAGIC) + len(arena_id)] != ARENA_MAGIC + arena_id.encode():
                    mm.close()
                    raise OSError(f"{path} is not arena {arena_id}")
                self._maps[key] = mm
                self._map_files[key] = (st.st_dev, st.st_ino)
            return mm

    def _prune_maps_locked(self) -> None:
        """Before mapping one more arena: unmap those whose sender is gone (its ``/proc/<pid>/fd``
        path no longer names the file mapped), then the least recently used beyond
        ``max_arenas - 1``."""
        for key in [k for k in self._maps if self._file_of(k[0]) != self._map_files.get(k)]:
            self._unmap_locked(key)
        for key in list(self._maps)[:max(0, len(self._maps) - (self.max_arenas - 1))]:
            self._unmap_locked(key)

    @staticmethod
    def _file_of(path: str) -> tuple[int, int] | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _unmap_locked(self, key: tuple[str, str | None]) -> None:
        self._map_files.pop(key, None)
        mm = self._maps.pop(key)
        try:
            mm.close()
        except BufferError:  # a zero-copy view of it is still alive: it is freed with the view
            pass

    def _fetch_tcp(self, handle: HandoffHandle, out: np.ndarray, deadline: float | None = None) -> None:
        """Fetch over TCP; with ``deadline`` (monotonic clock) everything ends by then."""
        addr = (handle.host, handle.port)
        rid = handle.request_id.encode()
        frame = REQ.pack(len(rid), handle.generation) + rid
        for attempt in (0, 1):  # a cached connection may have gone stale: retry once fresh
            with self._lock:
                sock = self._socks.pop(addr, None)
            fresh = sock is None
            try:
                if sock is None:
                    sock = socket.create_connection(addr, timeout=self._op_timeout(deadline))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._answer_challenge(sock, deadline)
                sock.settimeout(self._op_timeout(deadline))
                sock.sendall(frame)
                rep = bytearray(REP.size)
                recv_exact(sock, memoryview(rep), deadline)
                status, n = REP.unpack(rep)
                if status != 0:
                    self._keep(addr, sock)
                    raise HandoffStaleError(f"sender {addr} does not hold request {rid.decode()!r} "
                                            f"generation {handle.generation}")
                if n != out.nbytes:
                    sock.close()
                    raise HandoffError("size mismatch from sender")
                if n:
                    recv_exact(sock, memoryview(out.reshape(-1).view(np.uint8)), deadline)  # type: ignore[arg-type]  # numpy arrays are buffers
                self._keep(addr, sock)
                return
            except HandoffError:
                raise
            except OSError as e:  # TimeoutError included
                if sock is not None:
                    sock.close()
                if fresh or attempt == 1 or (deadline is not None and time.monotonic() >= deadline):
                    raise HandoffError(f"TCP fetch from {addr} failed: {e!r}") from e

    def _op_timeout(self, deadline: float | None) -> float:
        """One socket operation's bound: the receiver's ``timeout_s``, cut to what is left of
        ``deadline`` (:class:`TimeoutError` when nothing is)."""
        return self.timeout_s if deadline is None else min(self.timeout_s, time_left(deadline))

    def _answer_challenge(self, sock: socket.socket, deadline: float | None = None) -> None:
        if self.secret:
            from cpd.auth import HANDOFF_NONCE_BYTES, handoff_proof
            nonce = bytearray(HANDOFF_NONCE_BYTES)
            recv_exact(sock, memoryview(nonce), deadline)
            sock.sendall(handoff_proof(self.secret, bytes(nonce)))

    def _keep(self, addr, sock) -> None:
        with self._lock:
            old = self._socks.pop(addr, None)
            self._socks[addr] = sock
        if old is not None:
            old.close()

    def stats(self) -> dict:
        """Counters ``fetched_shm``, ``fetched_tcp``, ``viewed_shm``, ``bytes_fetched``,
        ``stale_detected`` (handles refused as not naming their staging), ``arenas_mapped``."""
        with self._lock:
            return {**self._st, "arenas_mapped": len(self._maps)}

    def close(self) -> None:
        """Unmap arenas and close connections (idempotent)."""
        with self._lock:
            maps, socks = list(self._maps.values()), list(self._socks.values())
            self._maps.clear()
            self._map_files.clear()
            self._socks.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass
        for s in socks:
            s.close()

    def __enter__(self) -> "HandoffReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
