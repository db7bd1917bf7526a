"""Block caches for trace analysis (LRU hit-ratio curves): a capacity-limited LRU that stays *prefix-closed*.

Invariant: whenever a block is present, all blocks before it in any request that touched
it are present too. It holds because every access touches a whole leading run, leaf
first and root last (so ancestors are always more recent than descendants), and
eviction takes the least recent block. Leading-run queries can then use binary search.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class BlockLRU:
    """LRU set of block ids with a capacity in blocks (``None`` = unbounded)."""

    __slots__ = ("capacity", "od")

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self.od: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.od)

    def __contains__(self, b: int) -> bool:
        return b in self.od

    def leading(self, blocks: Sequence[int], limit: int | None = None) -> int:
        """Length of the leading run of ``blocks`` present (binary search, prefix-closed)."""
        return leading_in(self.od, blocks, limit)

    def touch_insert(self, blocks: Sequence[int], room: int | None = None) -> tuple[list[int], list[int]]:
        """Insert/refresh ``blocks`` (a leading run), then evict down to ``room`` (default capacity).

        Returns:
            (newly inserted ids, evicted ids).
        """
        od = self.od
        new = []
        for b in reversed(blocks):
            if b in od:
                od.move_to_end(b)
            else:
                od[b] = None
                new.append(b)
        return new, self.shrink(room)

    def shrink(self, room: int | None = None) -> list[int]:
        """Evict least-recent blocks until at most ``room`` (default: capacity) remain."""
        cap = self.capacity if room is None else (room if self.capacity is None else min(room, self.capacity))
        if cap is None:
            return []
        od = self.od
        n = len(od) - max(0, cap)
        if n <= 0:
            return []
        pop = od.popitem
        return [pop(False)[0] for _ in range(n)]


def leading_in(s, blocks: Sequence[int], limit: int | None = None) -> int:
    """Largest k <= limit with ``blocks[k-1] in s`` assuming prefix-closed membership."""
    hi = len(blocks) if limit is None else min(limit, len(blocks))
    if hi == 0 or blocks[0] not in s:
        return 0
    if blocks[hi - 1] in s:
        return hi
    lo = 1  # blocks[lo-1] present, blocks[hi-1] absent
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if blocks[mid - 1] in s:
            lo = mid
        else:
            hi = mid
    return lo
