"""Trace statistics for ``cpd analyze``: prefix reuse, cold/warm split, reuse distance, cache sizing.

Works on Mooncake-format traces (512-token prefix-hash blocks; see
``../shared/data/traces/README.md``). Because hash ids are prefix hashes, the cached
prefix of a request under a cache is the leading run of its ids that the cache holds.
The last (partial) block is never counted as cached.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cpd.analyze.lru import BlockLRU
from cpd.sim.workload import SimRequest


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(math.ceil(q * len(s))) - 1))]


@dataclass(frozen=True)
class ReuseProfile:
    """Per-request infinite-cache reuse.

    Attributes:
        cached_tokens: tokens in the leading run of previously seen full blocks, per request.
        reuse: cached_tokens / prompt tokens, per request.
        reuse_distance_s: for requests whose hit is >= 2 blocks, seconds since the last block
            of the hit was last seen.
        token_hit_ratio: sum cached / sum prompt tokens.
    """

    cached_tokens: list[int]
    reuse: list[float]
    reuse_distance_s: list[float]
    token_hit_ratio: float


def reuse_profile(reqs: Sequence[SimRequest], block_tokens: int = 512, count_partial: bool = True
                  ) -> ReuseProfile:
    """Infinite-cache reuse of ``reqs`` taken in order (a block is cached once seen).

    With ``count_partial`` the last, partial block counts too when its id was seen before
    (an identical prompt repeated: its prefix hash matches); cached tokens are capped at
    the prompt length. This is the convention of the traces README (37.4 % for the
    conversation trace); without it, 37.3 %.
    """
    last_seen: dict[int, float] = {}
    cached, reuse, dist = [], [], []
    tot_c = tot_p = 0
    for r in reqs:
        ids = r.blocks
        nfull = len(ids) if count_partial else min(len(ids), r.prompt_tokens // block_tokens)
        k = 0
        while k < nfull and ids[k] in last_seen:
            k += 1
        c = min(k * block_tokens, r.prompt_tokens)
        if k >= 2:
            dist.append(r.arrival_s - last_seen[ids[k - 1]])
        cached.append(c)
        reuse.append(c / r.prompt_tokens if r.prompt_tokens else 0.0)
        tot_c += c
        tot_p += r.prompt_tokens
        for b in ids[:nfull]:
            last_seen[b] = r.arrival_s
    return ReuseProfile(cached, reuse, dist, tot_c / tot_p if tot_p else 0.0)


def lru_hit_ratio(reqs: Sequence[SimRequest], capacity_blocks: int | None, block_tokens: int = 512) -> float:
    """Token hit ratio of one LRU block cache of ``capacity_blocks`` (None = infinite)."""
    lru = BlockLRU(capacity_blocks)
    hit = tot = 0
    for r in reqs:
        nfull = min(len(r.blocks), r.prompt_tokens // block_tokens)
        full = r.blocks[:nfull]
        k = lru.leading(full)
        hit += k * block_tokens
        tot += r.prompt_tokens
        lru.touch_insert(full)
    return hit / tot if tot else 0.0


def capacity_for(reqs: Sequence[SimRequest], target_fraction: float, block_tokens: int = 512,
                 ) -> tuple[int, list[tuple[int, float]]]:
    """Smallest power-of-two LRU capacity (blocks) reaching ``target_fraction`` of the infinite hit ratio.

    Returns:
        (capacity in blocks, [(capacity, hit ratio), ...] tried).
    """
    inf = lru_hit_ratio(reqs, None, block_tokens)
    curve = []
    cap = 1024
    distinct = len({b for r in reqs for b in r.blocks})
    while True:
        h = lru_hit_ratio(reqs, cap, block_tokens)
        curve.append((cap, h))
        if h >= target_fraction * inf or cap >= distinct:
            return cap, curve
        cap *= 2
