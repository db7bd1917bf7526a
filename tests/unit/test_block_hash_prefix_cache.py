"""The C hash path's prefix cache (``cpd.kv.block_hash._PrefixCache``): a session's grown prompt
hashes only its new blocks, and a hit is byte-identical to a recompute, bounded, and never
crosses tenants (namespaces / parents)."""
from __future__ import annotations

import dataclasses
import random
from typing import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.kv import block_hash as bh
from cpd.kv.block_hash import Namespace, hash_blocks, hash_blocks_u32le
from test_block_hash import _reference_chain as _definition  # the definition, block by block

pytestmark = pytest.mark.skipif(bh._chain_native is None, reason="C extension cpd.kv._chain_sha256 not built")

NS = Namespace(model_id="test-model", weights_digest="w0", tokenizer_digest="t0")  # block_size 16


@pytest.fixture
def small_cache(monkeypatch) -> Iterator[bh._PrefixCache]:
    """A fresh cache with checkpoints every 2 blocks, at most 6 entries and 4 KiB."""
    cache = bh._PrefixCache(max_entries=6, max_bytes=4096)
    monkeypatch.setattr(bh, "_PREFIXES", cache)
    monkeypatch.setattr(bh, "CHECKPOINT_BLOCKS", 2)
    yield cache


def _check_bound(cache: bh._PrefixCache) -> None:
    assert len(cache) <= cache.max_entries and cache.nbytes <= cache.max_bytes
    assert cache.nbytes == sum(len(d) + len(h) for _, d, h in cache._d.values())


def test_grown_prompt_is_served_from_its_previous_turn(small_cache):
    rng = random.Random(3)
    turn1 = [rng.randrange(2**32) for _ in range(16 * 5 + 7)]  # 5 blocks: cached up to block 4
    turn2 = turn1 + [rng.randrange(2**32) for _ in range(40)]
    assert hash_blocks(turn1, NS) == _definition(turn1, NS)
    assert (small_cache.hits, len(small_cache)) == (0, 1)
    assert hash_blocks(turn2, NS) == _definition(turn2, NS)
    assert small_cache.hits == 1
    # a sibling of turn 2 (same turn 1, other tail) is served too: the shorter entry stays
    sibling = turn1 + [rng.randrange(2**32) for _ in range(40)]
    assert hash_blocks(sibling, NS) == _definition(sibling, NS) and small_cache.hits == 2
    # a token changed inside the cached head: no entry matches, the hashes follow the change
    edited = list(turn2)
    edited[20] ^= 1
    hits = small_cache.hits
    assert hash_blocks(edited, NS) == _definition(edited, NS) and small_cache.hits == hits
    _check_bound(small_cache)


def test_tenants_never_share_entries(small_cache):
    """The same tokens under another cache_salt (another root, another parent) are never served
    from the first tenant's entry; each tenant gets its own chain."""
    rng = random.Random(4)
    a, b = NS.with_salt("tenant-a"), NS.with_salt("tenant-b")
    toks = [rng.randrange(50000) for _ in range(16 * 8)]
    grown = toks + [rng.randrange(50000) for _ in range(32)]
    ha = hash_blocks(toks, a)
    hits = small_cache.hits
    hb = hash_blocks(grown, b)
    assert small_cache.hits == hits  # a's entry was there, keyed by a's root: not b's
    assert hb == _definition(grown, b) and hb[:len(ha)] != ha
    assert hash_blocks(grown, a) == _definition(grown, a) and small_cache.hits == hits + 1
    # an explicit parent is a parent like any other
    assert hash_blocks(grown, a, parent_hash=7) == _definition(grown, a, parent=7)


def test_key_collision_is_verified_not_trusted(small_cache):
    """Two prompts with the same checkpoint block but different earlier blocks: the second is
    not served the first's digests."""
    rng = random.Random(5)
    first = [rng.randrange(50000) for _ in range(16 * 4)]
    second = [rng.randrange(50000) for _ in range(16 * 3)] + first[48:64]  # block 3 equal, 0-2 not
    hash_blocks(first, NS)
    assert hash_blocks(second + [1] * 16, NS) == _definition(second + [1] * 16, NS)
    assert small_cache.hits == 0


def test_a_mutable_buffer_does_not_poison_the_cache(small_cache):
    """A bytearray is kept as a copy: changing it after it was hashed cannot make a prompt with
    the changed tokens verify against it and get the old tokens' digests."""
    toks = list(range(100, 100 + 16 * 6))
    buf = bytearray(np.asarray(toks, dtype="<u4").tobytes())
    assert hash_blocks_u32le(buf, NS) == _definition(toks, NS)
    buf[0] ^= 0xFF
    changed = [toks[0] ^ 0xFF] + toks[1:] + [9] * 16
    assert hash_blocks(changed, NS) == _definition(changed, NS)
    assert small_cache.hits == 0  # kept by reference, the changed buffer would have matched
    assert hash_blocks(toks + [9] * 16, NS) == _definition(toks + [9] * 16, NS)


def test_default_cache_is_bounded_and_serves_a_long_session():
    bh._PREFIXES.clear()
    rng = random.Random(6)
    session = [rng.randrange(50000) for _ in range(4096)]
    for _ in range(3):
        session += [rng.randrange(50000) for _ in range(700)]
        assert hash_blocks(session, NS) == _definition(session, NS)
    assert bh._PREFIXES.hits == 2
    _check_bound(bh._PREFIXES)
    assert bh._PREFIXES.max_bytes <= 64 << 20 and bh._PREFIXES.max_entries <= 4096


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 3, 16]),
       ops=st.lists(st.sampled_from(["grow", "sibling", "edit", "new", "salt", "cut"]), min_size=1, max_size=25))
def test_random_sessions_equal_the_definition(seed, block_size, ops):
    """Random sequences of grown, sibling, edited, new, other-tenant and shortened prompts
    through a tiny cache (evictions, collisions of short blocks): every answer equals the
    definition, and the cache stays within its bounds."""
    rng = random.Random(seed)
    cache = bh._PrefixCache(max_entries=5, max_bytes=rng.choice([600, 3000, 1 << 20]))
    saved = bh._PREFIXES, bh.CHECKPOINT_BLOCKS
    bh._PREFIXES, bh.CHECKPOINT_BLOCKS = cache, rng.choice([1, 2, 4])
    try:
        ns = dataclasses.replace(NS, block_size=block_size)
        prompts = [[rng.randrange(4) for _ in range(rng.randrange(0, 12 * block_size))]]  # tiny alphabet: equal blocks
        for op in ops:
            base = rng.choice(prompts)
            if op == "grow":
                p = base + [rng.randrange(4) for _ in range(rng.randrange(1, 6 * block_size))]
            elif op == "sibling":
                p = base[:rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
            elif op == "edit" and base:
                p = list(base)
                p[rng.randrange(len(p))] ^= 1
            elif op == "cut":
                p = base[:rng.randrange(len(base) + 1)]
            else:
                p = [rng.randrange(4) for _ in range(rng.randrange(0, 12 * block_size))]
            tenant = ns.with_salt(str(rng.randrange(3))) if op == "salt" else ns
            assert hash_blocks(p, tenant) == _definition(p, tenant)
            _check_bound(cache)
            prompts.append(p)
    finally:
        bh._PREFIXES, bh.CHECKPOINT_BLOCKS = saved
