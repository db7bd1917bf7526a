"""The handoff's exceptions."""
from __future__ import annotations


class HandoffError(Exception):
    """A handoff could not be completed (unknown request id, sender unreachable, bad handle)."""


class HandoffStaleError(HandoffError):
    """The handle no longer names a live staging: released, reclaimed, restaged for another
    request, or rewritten while being read. The data must not be used (re-prefill instead)."""
