"""KV cache events in vLLM's wire format (docs/architecture.md 'KV events').

Source: vLLM ``vllm/distributed/kv_events.py``. Events are msgspec structs encoded
as tagged msgpack arrays; a batch is ``[ts, [event, ...], data_parallel_rank]``.
On ZMQ PUB each batch is a 3-frame multipart message
``[topic, seq (8-byte big-endian int), payload]``; ``seq`` increases by one per
batch and per publisher, so a subscriber detects gaps and resynchronises.

Media (``medium`` field): ``"GPU"`` = L1 device pool, ``"CPU"`` = L2 host pool
(vLLM's names), ``"L3"`` = the shared store (global; the publisher id says who wrote).
"""
from __future__ import annotations

import struct
import time
from typing import Optional, Union

import msgspec

MEDIUM_L1 = "GPU"
MEDIUM_L2 = "CPU"
MEDIUM_L3 = "L3"
MEDIA = (MEDIUM_L1, MEDIUM_L2, MEDIUM_L3)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of all KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode_batch(events: list[KVCacheEvent], ts: float | None = None) -> bytes:
    """msgpack payload of one batch (``ts`` defaults to the wall clock, seconds)."""
    batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events)  # type: ignore[arg-type]
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Inverse of :func:`encode_batch`; raises ``msgspec.DecodeError`` on bad input."""
    return _decoder.decode(payload)


def pack_seq(seq: int) -> bytes:
    return struct.pack(">q", seq)


def unpack_seq(frame: bytes) -> int:
    seq: int = struct.unpack(">q", frame)[0]
    return seq
