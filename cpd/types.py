"""Domain types shared by the policy, the messages, the router and the workers.

The enums are ``str`` subclasses whose ``str()`` and format are their value, so JSON bodies,
metric labels and log lines read exactly as the bare strings they replace (``Role.PREFILL ==
"prefill"``); a value from the wire converts with ``Role(value)`` (ValueError if unknown).
"""
from __future__ import annotations

from enum import Enum
from typing import NewType


class _StrEnum(str, Enum):
    """A ``str`` enum that prints as its value (``enum.StrEnum`` exists only from Python 3.11)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Role(_StrEnum):
    """What a worker does (docs/architecture.md 'role')."""

    PRE_PREFILL = "pre-prefill"  # cold prompts: full prefill + write-through to L3
    PREFILL = "prefill"          # warm prompts: load the cached prefix, compute the suffix
    DECODE = "decode"


PREFILL_SIDE_ROLES = (Role.PRE_PREFILL, Role.PREFILL)


class Tier(_StrEnum):
    """Where a block's KV lives (docs/architecture.md 'tier')."""

    L1 = "L1"  # the worker's paged KV pool (device memory)
    L2 = "L2"  # the worker's host-DRAM pool
    L3 = "L3"  # the shared KV store


class Topology(_StrEnum):
    """How the prefill side is organised (docs/architecture.md 'topology')."""

    CPD = "cpd"  # cold prompts to the pre-prefill pool, warm ones to the prefill pool
    PD = "pd"    # plain prefill/decode disaggregation: every prompt to the prefill pool


class RoutingMode(_StrEnum):
    """How the policy picks the prefill-side pool (docs/architecture.md 'routing')."""

    STATIC = "static"      # reuse ratio vs cold_threshold -> fixed pool (the published CPD rule)
    ADAPTIVE = "adaptive"  # remaining-work estimates per candidate worker (issue 11)


class WriteThrough(_StrEnum):
    """Which prefills write their computed blocks through to the L3 store."""

    NONE = "none"  # no request (plain pd)
    COLD = "cold"  # requests the policy classifies cold, wherever they run (cpd)
    ALL = "all"    # every prefill (pd + L3: "pd-l3")


class RequestClass(_StrEnum):
    """The router's classification of a request for one routing decision (docs/architecture.md 'cold / warm')."""

    COLD = "cold"
    WARM = "warm"


BlockHash = NewType("BlockHash", int)
"""A chained, namespaced block hash (:mod:`cpd.kv.block_hash`): an unsigned 64-bit integer."""

__all__ = ["Role", "Tier", "Topology", "RoutingMode", "WriteThrough", "RequestClass", "BlockHash", "PREFILL_SIDE_ROLES"]
