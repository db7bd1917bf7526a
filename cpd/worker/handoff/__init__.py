"""KV handoff transport (package): move one request's KV (a contiguous array, e.g.
``[layers, 2, tokens, kv_heads, head_dim]`` float32, up to tens of MB) plus small JSON-able
metadata from the prefill-side worker (:class:`HandoffSender`) to the decode worker
(:class:`HandoffReceiver`). docs/architecture.md 'handoff'.

Paths
-----
* **Shared memory (same host).** The sender preallocates ONE arena at start (a file under
  ``/dev/shm`` mapped with ``MAP_POPULATE``; creating segments per request is slow) and manages
  it with a first-fit allocator (page-aligned regions, coalescing frees). ``stage`` copies the
  array in; the receiver maps each arena once (cached by name) and copies out. The region stays
  reserved until the sender's :meth:`HandoffSender.release` (the decode worker calls the
  sender's HTTP endpoint, which calls it) or until it is older than ``reclaim_after_s``.
* **TCP (cross host, or fallback).** The sender runs a small threaded TCP server. Request
  frame: ``u32 len | u64 generation | request_id (UTF-8)``; reply: ``u8 status (0 ok, 1 not
  held) | u64 nbytes | payload``, sent zero-copy with ``sendall(memoryview)`` straight from the
  arena or from the sender-side copy. The receiver ``recv_into``\\s a preallocated numpy array
  and keeps the connection for later fetches.

Identity of a staging (issue 7 §1: a late handoff never reads another request's KV)
-------------------------------------------------------------------------------------
A handle is bound to exactly one staging by ``(request_id, generation, checksum)``: the
generation is unique per sender (a counter from a random start), the checksum is xxh3-64 of the
payload. Every shm region starts with a 64-byte header ``magic | generation | nbytes |
checksum``; the sender zeroes the generation before it writes a payload and whenever it frees
a region, and writes the new generation only after the payload is complete (a seqlock with one
writer). A reader checks the header generation before and after its copy and the checksum of
what it copied: a reclaimed, restaged or half-rewritten region fails at least one check, every
time, and raises :class:`HandoffStaleError`. Over TCP the sender serves a request only if the
generation matches the entry it holds under that id, and the receiver checks the checksum.
:meth:`HandoffSender.release` with a generation never frees another staging of the same id.
Cost: one xxh3 pass on each side (≈ 8 GB/s here, against ≈ 3-10 GB/s for the copy itself).

Selection: every handle carries the sender's host identity (hostname + kernel boot id); the
receiver uses shared memory when the handle is ``kind == "shm"`` and the identity equals its
own, else TCP (``force_tcp`` forces TCP). When the arena is full, ``stage`` returns a
``kind == "tcp"`` handle (the array is then held as a private copy).

Handles are :class:`cpd.messages.handoff.HandoffHandle` values (that module documents the
fields); ``reclaim_after_s`` tells the holder of a handle how long the staging lives at most.

``dtype`` is numpy's ``dtype.str`` (e.g. ``"<f4"``). Torch CPU tensors are accepted by
``stage`` (converted with ``.numpy()``, so numpy-compatible dtypes only).

Modules (one concept each): :mod:`.errors` (the two exceptions), :mod:`.payload` (checksum,
host identity, array/handle layout), :mod:`.arena` (the shared-memory arena and its region
header), :mod:`.framing` (the TCP request/reply frames), :mod:`.sender`, :mod:`.receiver`.
"""
from cpd.worker.handoff.errors import HandoffError, HandoffStaleError
from cpd.worker.handoff.payload import host_identity, payload_checksum
from cpd.worker.handoff.receiver import HandoffReceiver
from cpd.worker.handoff.sender import HandoffSender

__all__ = ["HandoffSender", "HandoffReceiver", "HandoffError", "HandoffStaleError", "host_identity",
           "payload_checksum"]
