"""TCP frames of the handoff: request ``u32 len | u64 generation | request_id (UTF-8)``,
reply ``u8 status (0 ok, 1 not held) | u64 nbytes | payload``."""
from __future__ import annotations

import socket
import struct
import time

REQ = struct.Struct("<IQ")
REP = struct.Struct("<BQ")


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; with ``deadline`` (``time.monotonic()`` clock) the whole read,
    not each ``recv``, ends by then (:class:`TimeoutError`): a sender that trickles bytes cannot
    stretch it."""
    got, n = 0, view.nbytes
    while got < n:
        if deadline is not None:
            sock.settimeout(time_left(deadline))
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic clock); :class:`TimeoutError` when it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("handoff fetch deadline passed")
    return left
