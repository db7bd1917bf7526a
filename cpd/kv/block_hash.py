"""Chained, namespaced block hashes (DESIGN §2) — the one implementation used by
router, workers, store and simulator.

Definition (pinned by test vectors in ``tests/test_block_hash.py``)::

    root            = H(b"cpd-ns-v1" + canonical_json(namespace))
    h_{-1}          = root
    h_i             = H(u64be(h_{i-1}) + u32le(tokens_i) + extra_keys_i)
    H(x)            = first 8 bytes of SHA-256(x), read big-endian -> int in [0, 2**64)

Only *full* blocks (exactly ``block_size`` tokens) are hashed. Python's ``hash()``
and pickle are never used, so digests are identical across processes, machines
and Python versions. The scheme follows vLLM's prefix-caching design
(``vllm/v1/core/kv_cache_utils.py``: parent hash + block tokens + extra keys),
with SHA-256 over canonical bytes instead of pickle.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

HASH_VERSION = b"cpd-ns-v1"


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV non-interchangeable (DESIGN §2 'namespace').

    Two requests whose namespaces differ in any field never share a block.
    """

    model_id: str
    weights_digest: str
    tokenizer_digest: str
    block_size: int = 16
    kv_dtype: str = "float32"
    kv_layout: str = "paged-lbhd-v1"
    adapter_id: str = ""
    cache_salt: str = ""

    def with_salt(self, cache_salt: str | None) -> "Namespace":
        """Return a copy with the tenant ``cache_salt`` (``None`` keeps it)."""
        if cache_salt is None or cache_salt == self.cache_salt:
            return self
        d = asdict(self)
        d["cache_salt"] = cache_salt
        return Namespace(**d)

    def canonical_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces, UTF-8) of all fields."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    def root_hash(self) -> int:
        """``h_{-1}``: the hash every chain of this namespace starts from."""
        return _h(HASH_VERSION + self.canonical_bytes())


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def hash_block(parent_hash: int, block_token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
    """Hash one full block given its parent's hash.

    Args:
        parent_hash: ``h_{i-1}`` (the namespace root for the first block), in [0, 2**64).
        block_token_ids: the block's token ids (length ``block_size``), each in [0, 2**32).
        extra_keys: canonical bytes of per-block extra keys (e.g. multimodal hashes); usually empty.
    Returns:
        ``h_i`` as an int in [0, 2**64).
    """
    toks = np.asarray(block_token_ids, dtype="<u4").tobytes()
    return _h(struct.pack(">Q", parent_hash) + toks + extra_keys)


def hash_blocks(token_ids: Sequence[int], namespace: Namespace, parent_hash: int | None = None) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``.

    Args:
        token_ids: prompt token ids, length n.
        namespace: the KV namespace; its ``block_size`` sets the block length.
        parent_hash: start the chain from this hash instead of the namespace root
            (to extend an already-hashed prefix).
    Returns:
        ``n // block_size`` hashes; the trailing partial block is never hashed.
    """
    bs = namespace.block_size
    h = namespace.root_hash() if parent_hash is None else parent_hash
    out: list[int] = []
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    for i in range(len(arr) // bs):
        h = hash_block(h, arr[i * bs:(i + 1) * bs])
        out.append(h)
    return out


def hash_hex(h: int) -> str:
    """16-hex-digit rendering of a block hash (store keys, logs)."""
    return f"{h:016x}"
