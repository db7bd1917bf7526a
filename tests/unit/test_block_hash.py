"""Test vectors and properties of the chained, namespaced block hash (cpd.kv.block_hash)."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpd.kv import block_hash as bh
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


@pytest.fixture
def pure_python(monkeypatch):
    """The pure-Python path (``hashlib`` per block, group LRU), as where the C extension is not built."""
    monkeypatch.setattr(bh, "_chain_native", None)
    monkeypatch.setattr(bh, "_u32le_native", None)


def test_grouped_and_cached_hashing_equals_the_definition(pure_python):
    import random

    rng = random.Random(7)
    bh._GROUPS.clear()
    g = bh.GROUP_BLOCKS * NS.block_size
    for n in (0, 15, 16, g - 1, g, g + 16, 3 * g + 5):
        toks = [rng.randrange(2**32) for _ in range(n)]
        assert hash_blocks(toks, NS) == _reference_chain(toks, NS), n
        assert hash_blocks(toks, NS) == _reference_chain(toks, NS), n  # second time: from the cache
    assert bh._GROUPS.hits > 0


def test_growing_session_reuses_hashed_prefix_exactly(pure_python):
    import numpy as np

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


# --- the optional C extension (cpd/kv/_chain_sha256.c) against the pure-Python path -------------

native = pytest.mark.skipif(bh._chain_native is None, reason="C extension cpd.kv._chain_sha256 not built")


@native
@settings(max_examples=300, deadline=None)
@given(parent=st.binary(min_size=8, max_size=8), buf=st.binary(max_size=3000),
       step=st.integers(1, 300), cut=st.tuples(st.integers(0, 3000), st.integers(0, 3000)))
def test_native_chain_equals_python_chain(parent, buf, step, cut):
    start, stop = sorted(min(c, len(buf)) for c in cut)
    full = start + (stop - start) // step * step  # hash_blocks passes whole blocks only
    got = bh._chain_native(parent, buf, start, full, step)
    assert got == bh._chain_py(parent, buf, start, full, step)
    assert len(got) == 8 * ((stop - start) // step)
    assert bh._chain_native(parent, memoryview(buf), start, full, step) == got
    assert bh._chain_native(parent, buf, start, stop, step) == got  # a trailing partial block is not hashed


@native
def test_native_chain_rejects_bad_arguments():
    with pytest.raises(ValueError):
        bh._chain_native(b"1234567", b"x" * 64, 0, 64, 64)  # parent not 8 bytes
    for start, stop, step in ((0, 65, 64), (-1, 64, 64), (32, 0, 64), (0, 64, 0)):
        with pytest.raises(ValueError):
            bh._chain_native(b"12345678", b"x" * 64, start, stop, step)


@native
@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=200), as_tuple=st.booleans())
def test_native_u32le_equals_numpy(ids, as_tuple):
    seq = tuple(ids) if as_tuple else ids
    assert bh._u32le_native(seq) == np.asarray(ids, dtype="<u4").tobytes()


@native
def test_native_u32le_range_and_fallbacks():
    for bad in (-1, 2**32, 2**70, -(2**70)):
        with pytest.raises(ValueError):
            bh._u32le_native([1, 2, bad])
    assert bh._u32le_native([True, 7]) == np.asarray([1, 7], dtype="<u4").tobytes()
    # not a list/tuple of ints: None, and hash_blocks converts it the other way
    assert bh._u32le_native(np.arange(16)) is None
    assert bh._u32le_native(range(16)) is None
    assert bh._u32le_native([1, 2.0]) is None
    assert bh._u32le_native([1, np.int64(2)]) is None
    assert hash_blocks(range(32), NS) == hash_blocks([np.int64(i) for i in range(32)], NS) == [
        int(h, 16) for h in VECTOR_HEX]


@native
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), block_size=st.sampled_from([1, 3, 16, 64]),
       num_tokens=st.integers(0, 3 * 32 * 64 + 40), use_parent=st.booleans())
def test_hash_blocks_same_with_and_without_extension(seed, block_size, num_tokens, use_parent):
    """Random prompts, block sizes and parents: the C path equals the pure-Python path, both
    cold and through the group LRU (hashed twice, then grown by a tail)."""
    rng = random.Random(seed)
    ns = dataclasses.replace(NS, block_size=block_size)
    toks = [rng.randrange(2**32) for _ in range(num_tokens)]
    grown = toks + [rng.randrange(2**32) for _ in range(rng.randrange(1, 3 * block_size))]
    parent = rng.getrandbits(64) if use_parent else None
    got = [hash_blocks(t, ns, parent) for t in (toks, toks, grown, np.asarray(grown, dtype=np.int64))]
    saved = bh._chain_native, bh._u32le_native
    bh._chain_native = bh._u32le_native = None
    try:
        bh._GROUPS.clear()
        want = [hash_blocks(t, ns, parent) for t in (toks, toks, grown, np.asarray(grown, dtype=np.int64))]
        assert got == want
        assert want[0] == _reference_chain(toks, ns, parent)
        assert bh._GROUPS.hits >= 2 * (len(toks) // block_size // bh.GROUP_BLOCKS)  # the LRU path ran
    finally:
        bh._chain_native, bh._u32le_native = saved
