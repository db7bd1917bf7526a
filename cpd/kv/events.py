"""KV cache events in vLLM's wire format (docs/architecture.md 'KV events').

Source: vLLM ``vllm/distributed/kv_events.py``. Events are msgspec structs encoded
as tagged msgpack arrays; a batch is ``[ts, [event, ...], data_parallel_rank]``.
On ZMQ PUB each batch is a 3-frame multipart message
``[topic, seq (8-byte big-endian int), payload]``; ``seq`` increases by one per
batch and per publisher, so a subscriber detects gaps and resynchronises.

Media (``medium`` field): ``"GPU"`` = L1 device pool, ``"CPU"`` = L2 host pool
(vLLM's names), ``"L3"`` = the shared store (global; the publisher id says who wrote).

A ``BlockStored`` names a chain of blocks (vLLM's semantics): ``block_hashes[i]``'s parent is
``block_hashes[i - 1]``, the first one's is ``parent_block_hash``, and ``token_ids`` holds the tokens
of every block in that order. :func:`stored_runs` groups single blocks into such events.

The router's prefix index keys blocks by hash alone: its subscriber decodes with
:func:`decode_batch_for_index` (:class:`BlockStoredHashes`: same wire layout, ``token_ids`` left
undecoded), so a batch of long runs costs no int object per token.
"""
from __future__ import annotations

import itertools
import struct
import time
from typing import Iterable, Optional, Union

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


class BlockStoredHashes(KVCacheEvent, tag="BlockStored"):
    """A ``BlockStored`` as the router's prefix index reads it: the same wire layout (tag and
    fields), ``token_ids`` kept as the undecoded msgpack bytes (``msgspec.Raw``)."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: msgspec.Raw
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


STORED_TYPES = (BlockStored, BlockStoredHashes)  # a BlockStored, decoded either way


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


class IndexEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A :class:`KVEventBatch` as the router's prefix index reads it (:class:`BlockStoredHashes`)."""

    ts: float
    events: list[Union[BlockStoredHashes, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
_index_decoder = msgspec.msgpack.Decoder(type=IndexEventBatch)


def encode_batch(events: list[KVCacheEvent], ts: float | None = None) -> bytes:
    """msgpack payload of one batch (``ts`` defaults to the wall clock, seconds)."""
    batch = KVEventBatch(ts=time.time() if ts is None else ts, events=events)  # type: ignore[arg-type]
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Inverse of :func:`encode_batch`; raises ``msgspec.DecodeError`` on bad input."""
    return _decoder.decode(payload)


def decode_batch_for_index(payload: bytes) -> IndexEventBatch:
    """:func:`decode_batch` for the prefix index: ``BlockStored`` events as
    :class:`BlockStoredHashes` (their tokens not decoded); raises ``msgspec.DecodeError`` on bad input."""
    return _index_decoder.decode(payload)


def stored_runs(blocks: Iterable[tuple[int, Optional[int], list[int]]], block_size: int,
                medium: Optional[str]) -> list[BlockStored]:
    """``BlockStored`` events announcing ``blocks`` (``(hash, parent hash, token ids)`` each): every
    maximal stretch of consecutive items that forms a chain read forwards (each item's parent is
    the previous item's hash) or backwards (each item's hash is the previous item's parent: an LRU
    eviction of a released sequence, tail first) is one event, in chain order."""
    out: list[BlockStored] = []
    run: list[tuple[int, Optional[int], list[int]]] = []  # arrival order
    backwards = False
    for b in blocks:
        if run and (len(run) == 1 or not backwards) and b[1] == run[-1][0]:
            backwards = False
        elif run and (len(run) == 1 or backwards) and run[-1][1] == b[0]:
            backwards = True
        else:
            _close_run(out, run, backwards, block_size, medium)
            run = []
        run.append(b)
    _close_run(out, run, backwards, block_size, medium)
    return out


def _close_run(out: list[BlockStored], run: list[tuple[int, Optional[int], list[int]]], backwards: bool,
               block_size: int, medium: Optional[str]) -> None:
    if not run:
        return
    if backwards:
        run = run[::-1]
    tokens = run[0][2] if len(run) == 1 else list(itertools.chain.from_iterable(b[2] for b in run))
    out.append(BlockStored(block_hashes=[b[0] for b in run], parent_block_hash=run[0][1], token_ids=tokens,
                           block_size=block_size, medium=medium))


def pack_seq(seq: int) -> bytes:
    return struct.pack(">q", seq)


def unpack_seq(frame: bytes) -> int:
    seq: int = struct.unpack(">q", frame)[0]
    return seq
