"""Store faults: the one error family every L3 store operation raises (callers treat it as a
miss, never as a wrong answer), and the internal "this value is corrupt" signal."""
from __future__ import annotations


class StoreUnavailable(Exception):
    """The store cannot be reached (connection refused/reset, timeout, directory gone).
    The single error type every store operation raises for store faults; callers treat it
    as a miss (docs/architecture.md 'Fallbacks')."""


class StoreTimeout(StoreUnavailable):
    """The store did not answer within the configured timeout (a slow or stalled store)."""


class CorruptValue(Exception):
    """A stored value failed validation (internal; stores turn it into a miss)."""
