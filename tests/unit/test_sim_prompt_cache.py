"""The simulator's PromptCache: a prompt built from a cached prefix (a session's next turn) has the
same token ids and block hashes as the prompt computed from scratch, and the cache stays within
its byte bound."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from cpd.kv.block_hash import Namespace, hash_blocks_u32le
from cpd.sim.engine_sim import VOCAB, EngineSimulator, PromptCache, prompt_u32
from cpd.sim.workload import SimRequest

BS = 16
NS = Namespace(model_id="m", weights_digest="w", tokenizer_digest="t", block_size=BS)


def _fresh(blocks, num_tokens):
    ids = prompt_u32(blocks, num_tokens, BS)
    return ids, hash_blocks_u32le(ids.tobytes(), NS)


def _cached(cache: PromptCache, blocks, num_tokens):
    """EngineSimulator._prompt itself, on a stand-in holding only what it reads."""
    sim = SimpleNamespace(bs=BS, vocab_size=VOCAB, namespace=NS, _prompts=cache)
    r = SimRequest(0.0, num_tokens, 1, tuple(blocks))
    return EngineSimulator._prompt(sim, r)


def test_next_turn_from_the_cache_equals_the_fresh_prompt():
    cache = PromptCache(BS)
    turns = [(1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7), (1, 2, 9)]
    for k, blocks in enumerate(turns):
        num_tokens = len(blocks) * BS - (5 if k % 2 else 0)  # some end in a partial block
        ids, hashes = _cached(cache, blocks, num_tokens)
        want_ids, want_hashes = _fresh(blocks, num_tokens)
        assert ids.dtype == want_ids.dtype and np.array_equal(ids, want_ids) and hashes == want_hashes
    assert (cache.hits, cache.misses) == (2, 2)  # (1, 2, 9): only a whole entry is a prefix (no (1, 2) entry)


def test_cache_is_bounded_by_bytes():
    cache = PromptCache(BS, max_bytes=3 * BS * 4)
    for b in range(10):
        ids, hashes = _fresh((100 + b,), BS)
        cache.put((100 + b,), ids, hashes)
    assert cache.nbytes <= 3 * BS * 4 and cache.longest((100,), 1)[0] == 0 and cache.longest((109,), 1)[0] == 1
