"""``SET key value NX`` for many chunks written as raw RESP straight from the array buffers: no
join of the payload and no packing copy in the client, all commands pipelined on one connection
(the fast put path of the Redis stores, where writing, sealing and publishing are one command)."""
from __future__ import annotations

import redis


def join_parts(parts: list) -> bytearray:
    """One buffer holding ``parts`` back to back (the slow paths that need a single value)."""
    out = bytearray(sum(len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes for p in parts))
    pos = 0
    for p in parts:
        ln = len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes
        out[pos:pos + ln] = p
        pos += ln
    return out


def part_len(p) -> int:
    return len(p) if isinstance(p, (bytes, bytearray)) else p.nbytes


def set_nx_many(pool, entries: list[tuple[bytes, list]], ttl_ms: int = 0) -> list:
    """``SET key value NX`` written as raw RESP straight from the numpy buffers (no join,
    no hiredis packing copy), all commands pipelined on one connection, then all replies
    read (error replies are returned as exception objects)."""
    if ttl_ms > 0:
        t = b"%d" % ttl_ms
        n_args, tail = b"*6", b"\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(t), t)
    else:
        n_args, tail = b"*4", b"\r\n$2\r\nNX\r\n"
    conn = pool.get_connection()
    try:
        for k, parts in entries:
            vlen = sum(part_len(p) for p in parts)
            hdr = b"%s\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (n_args, len(k), k, vlen)
            conn.send_packed_command([hdr, *parts, tail])
        replies = []
        for _ in entries:
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as e:  # reply consumed: the connection stays in sync
                replies.append(e)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    return replies
