"""TCP frames of the handoff: request ``u32 len | u64 generation | request_id (UTF-8)``,
reply ``u8 status (0 ok, 1 not held) | u64 nbytes | payload``."""
from __future__ import annotations

import socket
import struct

REQ = struct.Struct("<IQ")
REP = struct.Struct("<BQ")


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k
