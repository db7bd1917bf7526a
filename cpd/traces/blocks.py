"""Token blocks: the one conversion of trace block ids into replayed token ids and block ids.

Convention (``shared/data/traces/README.md``):

* a trace block is named by ``(scope, hash id)``; ``scope`` is None for global ids (Mooncake) and
  the conversation id for Claude Code, whose ids are local to a conversation. ``block_key``
  turns the pair into one integer: ``h`` itself for global ids (so Mooncake prompts are the same
  as before this module existed), else a 63-bit BLAKE2b of ``"scope\\0h"``;
* ``tokens(key)`` = the trace block's token ids drawn uniformly from the vocabulary minus the
  special ids by ``numpy.random.default_rng([seed, key])``, independent of the order in which keys
  are first seen; a shorter block is a prefix of the full one;
* ``tokens_per_block`` (``tpb``) shrinks every block for CPU runs: a full block becomes ``tpb``
  tokens, a partial one of ``L`` tokens ``max(1, round_half_up(L * tpb / block_tokens))``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np


def block_key(scope: str | None, h: int) -> int:
    """Integer identity of block ``h`` in ``scope`` (``h`` for global ids, else a 63-bit hash)."""
    if scope is None:
        return int(h)
    digest = hashlib.blake2b(f"{scope}\0{h}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def shrink(length: int, block_tokens: int, tokens_per_block: int) -> int:
    """Replayed tokens of a trace block of ``length`` tokens (see module docstring)."""
    if not 1 <= tokens_per_block <= block_tokens:
        raise ValueError(f"tokens_per_block must be in [1, {block_tokens}], got {tokens_per_block}")
    if length == block_tokens:
        return tokens_per_block
    return max(1, (2 * length * tokens_per_block + block_tokens) // (2 * block_tokens))


def truncate_blocks(lens: list[int], cap: int) -> int:
    """How many leading blocks fit in ``cap`` tokens (whole blocks; 0 if even the first does not)."""
    total = keep = 0
    for n in lens:
        if total + n > cap:
            break
        total += n
        keep += 1
    return keep


@dataclass(frozen=True)
class Vocab:
    """The token space prompts are drawn from.

    ``size``: vocabulary size (ids ``0 .. size-1``); ``special_ids``: ids never drawn (BOS, EOS,
    pad, chat-template markers, ...). ``source`` says where the numbers came from.
    """

    size: int
    special_ids: tuple[int, ...] = ()
    source: str = "given"

    def allowed(self) -> np.ndarray:
        """Sorted int64 array of drawable ids. Raises ``ValueError`` if none is left."""
        ids = np.arange(self.size, dtype=np.int64)
        if self.special_ids:
            ids = np.setdiff1d(ids, np.asarray(self.special_ids, dtype=np.int64))
        if ids.size == 0:
            raise ValueError(f"vocabulary of size {self.size} has no non-special ids")
        return ids


def vocab_from_tokenizer(path: str | Path) -> Vocab:
    """Read vocabulary size and special ids from a Hugging Face tokenizer dir (or hub-cached name).

    ``size`` is ``len(tokenizer)`` (base vocab plus added tokens); ``special_ids`` are
    ``tokenizer.all_special_ids`` plus every added token flagged ``special``.
    Raises whatever ``transformers.AutoTokenizer.from_pretrained`` raises for a bad path.
    """
    from transformers import AutoTokenizer  # lazy: heavy import

    tok = AutoTokenizer.from_pretrained(str(path))
    special = set(int(i) for i in tok.all_special_ids)
    for tid, added in getattr(tok, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            special.add(int(tid))
    return Vocab(size=len(tok), special_ids=tuple(sorted(special)), source=f"tokenizer:{path}")


_SIZE_KEYS = ("vocab_size", "n_vocab")
_SPECIAL_KEYS = ("special_token_ids", "special_ids", "all_special_ids")


def vocab_from_model_card(card: dict[str, Any]) -> Vocab | None:
    """Vocab from one entry of ``GET /v1/models`` ``data``, if the server advertises it.

    Looks for ``vocab_size`` (or ``n_vocab``) and ``special_token_ids`` (or ``special_ids`` /
    ``all_special_ids``) at the top level of the entry or in a nested ``metadata`` / ``cpd`` /
    ``tokenizer`` object. Returns ``None`` when no vocabulary size is found.
    """
    places = [card] + [card[k] for k in ("metadata", "cpd", "tokenizer") if isinstance(card.get(k), dict)]
    for place in places:
        size = next((place[k] for k in _SIZE_KEYS if isinstance(place.get(k), int)), None)
        if size is None:
            continue
        special: Iterable[int] = ()
        for p in places:
            found = next((p[k] for k in _SPECIAL_KEYS if isinstance(p.get(k), list)), None)
            if found is not None:
                special = found
                break
        return Vocab(size=int(size), special_ids=tuple(sorted(int(i) for i in special)),
                     source=f"model_card:{card.get('id', '?')}")
    return None


class BlockTokens:
    """``tokens(h)``: the deterministic token block of block key ``h`` (see :func:`block_key`).

    ``BlockTokens(vocab, seed)(h, k)`` returns the first ``k`` (default 512) ids of the block as a
    list of ints. The full 512-id block is always drawn from ``default_rng([seed, h])`` and then
    sliced, so a partial or shrunk block is a prefix of the full one and the result never depends on
    call order. Up to ``cache_blocks`` blocks are memoised (2 KiB each, int32; oldest dropped first).
    """

    def __init__(self, vocab: Vocab, seed: int = 0, block: int = 512, cache_blocks: int = 65536):
        if seed < 0:
            raise ValueError("seed must be >= 0")
        self.vocab = vocab
        self.seed = int(seed)
        self.block = int(block)
        self._allowed = vocab.allowed()
        self._cache: dict[int, np.ndarray] = {}
        self._cache_blocks = max(0, int(cache_blocks))

    def full(self, h: int) -> np.ndarray:
        """All ``block`` ids of hash id ``h`` (int32 array, do not modify). ``h`` must be >= 0."""
        arr = self._cache.get(h)
        if arr is None:
            if h < 0:
                raise ValueError(f"hash id must be >= 0, got {h}")
            rng = np.random.default_rng([self.seed, int(h)])
            arr = self._allowed[rng.integers(0, self._allowed.size, size=self.block)].astype(np.int32)
            if self._cache_blocks:
                if len(self._cache) >= self._cache_blocks:
                    del self._cache[next(iter(self._cache))]
                self._cache[h] = arr
        return arr

    def __call__(self, h: int, k: int | None = None) -> list[int]:
        k = self.block if k is None else k
        if not 0 <= k <= self.block:
            raise ValueError(f"block length {k} outside [0, {self.block}]")
        return self.full(h)[:k].tolist()


