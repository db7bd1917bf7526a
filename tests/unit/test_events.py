"""KV events: msgpack round trip and vLLM-compatible (array-like, tagged) layout."""
from __future__ import annotations

import msgspec

from cpd.kv.events import (MEDIUM_L3, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                           decode_batch, encode_batch, pack_seq, unpack_seq)


def _events():
    return [
        BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=list(range(32)),
                    block_size=16, medium=MEDIUM_L3),
        BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[5] * 16, block_size=16, lora_id=7,
                    medium="GPU"),
        BlockRemoved(block_hashes=[1, 3], medium="CPU"),
        AllBlocksCleared(),
    ]


def test_round_trip():
    payload = encode_batch(_events(), ts=123.5)
    batch = decode_batch(payload)
    assert batch == KVEventBatch(ts=123.5, events=_events())
    assert batch.events[0].block_hashes[1] == 2**64 - 1


def test_layout_is_tagged_arrays():
    raw = msgspec.msgpack.decode(encode_batch(_events(), ts=1.0))
    # batch = [ts, [events...], data_parallel_rank]
    assert raw[0] == 1.0 and isinstance(raw[1], list) and len(raw) in (2, 3)
    assert raw[2:] in ([], [None])
    stored, stored2, removed, cleared = raw[1]
    # each event = [tag, fields...] in declaration order (vLLM kv_events wire format)
    assert stored == ["BlockStored", [1, 2**64 - 1], None, list(range(32)), 16, None, "L3"]
    assert stored2 == ["BlockStored", [3], 2, [5] * 16, 16, 7, "GPU"]
    assert removed == ["BlockRemoved", [1, 3], "CPU"]
    assert cleared == ["AllBlocksCleared"]


def test_decode_vllm_shaped_payload():
    # hand-built payload as a vLLM publisher (no medium field, older layout) would send
    payload = msgspec.msgpack.encode([2.0, [["BlockStored", [9], None, [1] * 16, 16, None],
                                            ["BlockRemoved", [9]]], 0])
    b = decode_batch(payload)
    assert b.data_parallel_rank == 0
    assert b.events[0] == BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1] * 16, block_size=16)
    assert b.events[1] == BlockRemoved(block_hashes=[9])


def test_seq_frames():
    assert unpack_seq(pack_seq(42)) == 42
    assert pack_seq(1) == b"\x00" * 7 + b"\x01"
