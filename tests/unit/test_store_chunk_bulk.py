"""The store's bulk paths equal their one-chunk definitions: :func:`encode_chunks` gives, for
each range, the bytes :func:`encode_parts` gives for that chunk (shared block arrays, mixed
dtypes, non-contiguous blocks, chunk sizes 1-3); :func:`cover` with one block per chunk is the
run of present leading blocks; a value decodes to the blocks it was encoded from."""
from __future__ import annotations

import random

import numpy as np
import pytest

from cpd.store.chunk_format import decode_value, encode_chunks, encode_parts, encode_value
from cpd.store.chunk_keys import cover, split_chunks
from cpd.store.errors import CorruptValue


def _joined(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _encode_each(hs, blocks, ranges, bs):
    try:
        return [_joined(encode_parts(hs[s:e], blocks[s:e], bs)) for s, e in ranges]
    except ValueError:
        return "ValueError"


def _encode_bulk(hs, blocks, ranges, bs):
    try:
        return [_joined(p) for p in encode_chunks(hs, blocks, ranges, bs)]
    except ValueError:
        return "ValueError"


@pytest.mark.parametrize("seed", range(4))
def test_encode_chunks_is_encode_parts_per_chunk(seed):
    rng, rnd = np.random.default_rng(seed), random.Random(seed)
    kinds = {"shared": 0, "mixed": 0}
    for _ in range(80):
        n, per_chunk = rnd.randrange(1, 12), rnd.randrange(1, 4)
        shared = rng.integers(0, 9, (2, 2, 8, 1, 3)).astype(np.float16)
        blocks = [shared if rnd.random() < 0.5 else rng.integers(0, 9, (2, 2, 8, 1, 3)).astype(np.float16)
                  for _ in range(n)]
        if rnd.random() < 0.2:
            blocks[rnd.randrange(n)] = rng.integers(0, 9, (2, 2, 8, 1, 3)).astype(np.float32)
            kinds["mixed"] += 1
        if rnd.random() < 0.2:
            blocks = [b[:, :, ::2] for b in blocks]  # non-contiguous views
        kinds["shared"] += sum(b is shared for b in blocks) > 1
        hs = [rnd.randrange(0, 2 ** 64) for _ in range(n)]
        ranges = [r for r in split_chunks(n, per_chunk) if rnd.random() < 0.8]
        bs = rnd.choice([None, 8, 0])
        assert _encode_bulk(hs, blocks, ranges, bs) == _encode_each(hs, blocks, ranges, bs)
    assert kinds["shared"] and kinds["mixed"]


def test_encoded_chunks_decode_to_their_blocks():
    rng = np.random.default_rng(7)
    blocks = [rng.standard_normal((2, 2, 4, 1, 2)).astype(np.float16) for _ in range(5)]
    hs = [11, 22, 33, 44, 55]
    for (s, e), parts in zip(split_chunks(5, 2), encode_chunks(hs, blocks, split_chunks(5, 2))):
        ch = decode_value(_joined(parts), expect_last=hs[e - 1], expect_n=e - s)
        assert ch.block_hashes == hs[s:e] and ch.block_size == 4
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(ch.blocks, blocks[s:e]))
        assert not ch.blocks[0].flags.writeable  # views of the bytes read


def test_decode_refuses_a_flipped_byte():
    v = bytearray(encode_value([9], [np.ones((2, 2, 4, 1, 2), np.float16)]))
    v[len(v) // 2] ^= 0xFF
    with pytest.raises(CorruptValue, match="checksum"):
        decode_value(bytes(v), expect_last=9, expect_n=1)


def _cover_by_intervals(present, hs):
    """The general rule (chunks of any size) written out for one-block chunks."""
    covered = 0
    for j, h in enumerate(hs):
        if j == covered and present.get((h, 1)):
            covered += 1
    return covered, [(j, j, (h, 1)) for j, h in enumerate(hs[:covered])]


def test_cover_one_block_chunks_is_the_leading_present_run():
    rnd = random.Random(3)
    for _ in range(500):
        hs = [rnd.randrange(1, 30) for _ in range(rnd.randrange(0, 25))]  # repeats on purpose
        present = {(h, 1): rnd.random() < 0.9 for h in hs if rnd.random() < 0.85}
        assert cover(present, hs, 1) == _cover_by_intervals(present, hs)
