"""The handoff handle: what a prefill-side worker gives the router, and the router the decode
worker, so that the decode worker can fetch one staged request's KV (:mod:`cpd.worker.handoff`).

A handle names exactly one staging by ``(request_id, generation, checksum)`` (issue 7 §1):
``generation`` is unique per sender, ``checksum`` is xxh3-64 of the payload. ``kind`` says
where the payload lies: ``"shm"`` in the sender's shared-memory arena (``name``, ``arena_id``,
``offset`` set; readable on the host ``host_id`` names), ``"tcp"`` only behind the sender's
TCP server (``host``, ``port``; an shm handle can always be fetched over TCP too).
``reclaim_after_s`` bounds how long the staging lives (counted from staging), so a router can
bound its own waits by it. ``release_url`` is set by the worker's HTTP layer: ``POST`` a
:class:`HandoffRelease` there to free the staging.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec

HandoffKind = Literal["shm", "tcp"]


class HandoffHandle(msgspec.Struct, frozen=True, kw_only=True):
    """One staged request's KV: where it is, its layout and its identity."""

    kind: HandoffKind
    host: str
    port: int
    request_id: str
    nbytes: int
    dtype: str                 # numpy ``dtype.str``, e.g. ``"<f4"``
    shape: tuple[int, ...]
    host_id: str               # ``"<hostname>/<kernel boot id>"`` of the sender
    generation: int
    checksum: int
    reclaim_after_s: float
    meta: dict[str, Any] = {}
    name: str | None = None      # shm: path of the arena (``/proc/<pid>/fd/<fd>`` or a file)
    arena_id: str | None = None  # shm: the arena's id, checked against its header
    offset: int | None = None    # shm: payload offset in the arena
    release_url: str | None = None


class HandoffRelease(msgspec.Struct, frozen=True):
    """Body of ``POST /handoff/release``: free that staging only (``generation`` given) or
    whatever is staged under ``request_id`` (``generation`` None)."""

    request_id: str
    generation: int | None = None


__all__ = ["HandoffHandle", "HandoffRelease", "HandoffKind"]
