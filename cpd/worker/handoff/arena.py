"""The sender's shared-memory arena: one preallocated mapping, a first-fit allocator of
page-aligned regions, and the 64-byte region header (``magic | generation | nbytes | checksum``)
that makes a region's identity checkable by readers (the seqlock of the package docstring)."""
from __future__ import annotations

import mmap
import os
import struct
import uuid
import weakref

import numpy as np

ALIGN = 4096
ARENA_MAGIC = b"CPDARENA"
REGION_HDR = struct.Struct("<8sQQQ")  # magic | generation (0 = no valid payload) | nbytes | checksum
REGION_MAGIC = b"CPDSTAGE"
HDR_BYTES = 64  # payload starts 64 bytes into its region (aligned for every dtype)
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


class Arena:
    """A preallocated shared mapping with a first-fit allocator (not thread-safe itself).

    On Linux the arena is an anonymous ``memfd`` that receivers open as
    ``/proc/<pid>/fd/<fd>``: it has no name in ``/dev/shm``, so the kernel frees it when the
    sender exits, even on SIGKILL (a named segment would leak). The first page holds a header
    (magic + arena id) that receivers check, so a recycled pid/fd never maps someone else's data.
    Elsewhere it falls back to a named file under /dev/shm or /tmp, unlinked on close.
    """

    def __init__(self, size: int, prefix: str):
        self.size = (max(int(size), ALIGN) + ALIGN - 1) // ALIGN * ALIGN + ALIGN
        self.arena_id = uuid.uuid4().hex
        self.fd = None
        if hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd"):
            self.fd = os.memfd_create(f"{prefix}-{self.arena_id[:8]}", 0)
            self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
            fd = self.fd
            self._finalizer: weakref.finalize = weakref.finalize(self, _close_quiet, self.fd)
        else:
            d = _SHM_DIR or "/tmp"
            self.path = os.path.join(d, f"{prefix}-{os.getpid()}-{self.arena_id[:8]}")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._finalizer = weakref.finalize(self, _unlink_quiet, self.path)
        try:
            os.ftruncate(fd, self.size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.size, flags=flags)
        finally:
            if self.fd is None:
                os.close(fd)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        hdr = ARENA_MAGIC + self.arena_id.encode()
        self.buf[:len(hdr)] = np.frombuffer(hdr, dtype=np.uint8)
        self.free: list[list[int]] = [[ALIGN, self.size - ALIGN]]  # sorted [offset, length]

    def alloc(self, nbytes: int) -> int | None:
        need = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        for i, (off, ln) in enumerate(self.free):
            if ln >= need:
                if ln == need:
                    del self.free[i]
                else:
                    self.free[i] = [off + need, ln - need]
                return off
        return None

    def dealloc(self, off: int, nbytes: int) -> None:
        ln = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        fl = self.free
        lo, hi = 0, len(fl)
        while lo < hi:
            mid = (lo + hi) // 2
            if fl[mid][0] < off:
                lo = mid + 1
            else:
                hi = mid
        fl.insert(lo, [off, ln])
        if lo + 1 < len(fl) and fl[lo][0] + fl[lo][1] == fl[lo + 1][0]:
            fl[lo][1] += fl[lo + 1][1]
            del fl[lo + 1]
        if lo > 0 and fl[lo - 1][0] + fl[lo - 1][1] == fl[lo][0]:
            fl[lo - 1][1] += fl[lo][1]
            del fl[lo]

    def free_bytes(self) -> int:
        return sum(ln for _, ln in self.free)

    def close(self) -> None:
        try:
            del self.buf
            self.mm.close()
        except (BufferError, AttributeError):
            pass
        self._finalizer()


def _close_quiet(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
