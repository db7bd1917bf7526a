"""``POST /cpd/index/match``: where a prompt's leading blocks are, as the router sees them now.

The answer is the router's own :meth:`cpd.router.index.PrefixIndex.match` of the prompt's
block hashes in the caller's namespace (its tenant's, narrowed by ``cache_salt`` exactly as a
generation request's), in blocks per tier and worker: what the policy would plan on if the
request arrived now. A caller can only see blocks of its own namespace, since the hashes of
another tenant's blocks are never computed. Its uses: operators asking "who holds this
prompt?", and tests and benchmarks waiting until KV events have reached the index instead of
sleeping for a guess.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.policy.routing import max_cached_blocks
from cpd.router.api_keys import effective_cache_salt
from cpd.router.index import PrefixIndex

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2 ** 32)]


class IndexMatchQuery(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /cpd/index/match``."""

    prompt_token_ids: list[TokenId]
    cache_salt: str | None = None


def match_prompt(index: PrefixIndex, namespace: Namespace, query: IndexMatchQuery, tenant: str | None) -> dict:
    """The index's view of ``query``'s prompt: ``num_blocks`` (full blocks of the prompt),
    ``l1`` / ``l2`` (worker id → leading blocks held there, L2 continuing L1), ``l3`` (leading
    blocks visible in the shared store), ``l3_after`` (worker id → end of the L3 run after its
    local run) and ``l3_pending`` (blocks being written through now), as
    :class:`cpd.policy.routing.PrefixMatch` defines them."""
    salt = effective_cache_salt(tenant, query.cache_salt)
    hashes = hash_blocks(query.prompt_token_ids, namespace.with_salt(salt))
    m = index.match(hashes, l3_max_blocks=max_cached_blocks(len(query.prompt_token_ids), namespace.block_size))
    return {"num_blocks": len(hashes), "l1": dict(m.l1), "l2": dict(m.l2), "l3": m.l3,
            "l3_after": dict(m.l3_after), "l3_pending": m.l3_pending}
