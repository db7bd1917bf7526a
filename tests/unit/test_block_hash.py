"""Test vectors and properties of the chained, namespaced block hash (cpd.kv.block_hash)."""
from __future__ import annotations

import dataclasses

import pytest

from cpd.kv.block_hash import Namespace, hash_block, hash_blocks, hash_hex

NS = Namespace(model_id="test-model", weights_digest="w0", tokenizer_digest="t0")  # block_size 16

# Pinned once from the reference implementation: changing them breaks every cache and index.
ROOT_HEX = "4ab8db70a9a425e9"
VECTOR_HEX = ["a452f8147ec9d1c6", "27f75acd1e68af9c"]


def test_root_hash_vector():
    assert hash_hex(NS.root_hash()) == ROOT_HEX
    assert NS.canonical_bytes() == (
        b'{"adapter_id":"","block_size":16,"cache_salt":"","kv_dtype":"float32",'
        b'"kv_layout":"paged-lbhd-v1","model_id":"test-model","tokenizer_digest":"t0","weights_digest":"w0"}')


def test_block_hash_vectors():
    assert [hash_hex(h) for h in hash_blocks(list(range(32)), NS)] == VECTOR_HEX


def test_chaining_property():
    hs = hash_blocks(list(range(32)), NS)
    assert hs[0] == hash_block(NS.root_hash(), list(range(16)))
    assert hs[1] == hash_block(hs[0], list(range(16, 32)))
    # extending from a parent hash equals hashing the whole prefix
    assert hash_blocks(list(range(16, 32)), NS, parent_hash=hs[0]) == hs[1:]
    # a changed first block changes every later hash, though block 2's tokens are equal
    other = hash_blocks([1] + list(range(1, 32)), NS)
    assert other[0] != hs[0] and other[1] != hs[1]


def test_partial_blocks_not_hashed():
    assert hash_blocks(list(range(15)), NS) == []
    assert hash_blocks(list(range(40)), NS) == hash_blocks(list(range(32)), NS)
    assert len(hash_blocks(list(range(47)), NS)) == 2


def test_token_range_checked():
    with pytest.raises(ValueError):
        hash_blocks([-1] * 16, NS)
    with pytest.raises(ValueError):
        hash_blocks([2**32] * 16, NS)


def test_extra_keys_change_hash():
    assert hash_block(1, list(range(16)), b"img:abc") != hash_block(1, list(range(16)))


@pytest.mark.parametrize("change", [
    {"cache_salt": "tenant-b"}, {"weights_digest": "w1"}, {"block_size": 8}, {"model_id": "other"},
    {"tokenizer_digest": "t1"}, {"adapter_id": "lora-1"}, {"kv_dtype": "bfloat16"}, {"kv_layout": "x"},
])
def test_namespace_isolation(change):
    toks = list(range(64))
    other = dataclasses.replace(NS, **change)
    a, b = set(hash_blocks(toks, NS)), set(hash_blocks(toks, other))
    assert a and b and not (a & b)
    assert NS.root_hash() != other.root_hash()


def test_same_namespace_positive_control():
    toks = list(range(64))
    twin = Namespace(model_id="test-model", weights_digest="w0", tokenizer_digest="t0")
    assert hash_blocks(toks, twin) == hash_blocks(toks, NS)
    assert NS.with_salt(None) is NS and NS.with_salt("") is NS
    assert NS.with_salt("s").cache_salt == "s"


def _reference_chain(toks, ns, parent=None):
    """The definition, block by block (no grouping, no cache)."""
    h, out = (ns.root_hash() if parent is None else parent), []
    for i in range(len(toks) // ns.block_size):
        h = hash_block(h, toks[i * ns.block_size:(i + 1) * ns.block_size])
        out.append(h)
    return out


def test_grouped_and_cached_hashing_equals_the_definition():
    import random

    from cpd.kv import block_hash as bh
    rng = random.Random(7)
    bh._GROUPS.clear()
    g = bh.GROUP_BLOCKS * NS.block_size
    for n in (0, 15, 16, g - 1, g, g + 16, 3 * g + 5):
        toks = [rng.randrange(2**32) for _ in range(n)]
        assert hash_blocks(toks, NS) == _reference_chain(toks, NS), n
        assert hash_blocks(toks, NS) == _reference_chain(toks, NS), n  # second time: from the cache
    assert bh._GROUPS.hits > 0


def test_growing_session_reuses_hashed_prefix_exactly():
    import numpy as np

    from cpd.kv import block_hash as bh
    bh._GROUPS.clear()
    g = bh.GROUP_BLOCKS * NS.block_size
    turn1 = list(range(1000, 1000 + 2 * g + 7))
    turn2 = turn1 + list(range(5, 5 + g))
    h1 = hash_blocks(turn1, NS)
    hits0 = bh._GROUPS.hits
    h2 = hash_blocks(turn2, NS)
    assert bh._GROUPS.hits - hits0 == 2  # both full groups of turn 1 reused
    assert h2[:len(h1)] == h1 and h2 == _reference_chain(turn2, NS)
    # a changed token inside a cached group is a miss, not a stale hit
    turn3 = list(turn2)
    turn3[3] += 1
    assert hash_blocks(turn3, NS) == _reference_chain(turn3, NS) and hash_blocks(turn3, NS)[0] != h2[0]
    # the same ids as an array, and from a parent hash, agree
    assert hash_blocks(np.asarray(turn2, dtype=np.int64), NS) == h2
    assert hash_blocks(turn2[16:], NS, parent_hash=h2[0]) == h2[1:]


def test_token_range_checked_for_arrays():
    import numpy as np
    with pytest.raises(ValueError):
        hash_blocks(np.full(16, -1, dtype=np.int64), NS)
    with pytest.raises(ValueError):
        hash_blocks(np.full(16, 2**32, dtype=np.int64), NS)
