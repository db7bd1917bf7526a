"""The router's chat tokenization through :class:`cpd.router.tokenization.SegmentCache` gives exactly
the ids of encoding the whole rendered text (SmolLM2's real tokenizer), reuses a session's earlier
messages, and never answers one scope (tenant, cache salt) from another's entries."""
from __future__ import annotations

import random

import pytest

from cpd.router.tokenization import SegmentCache, Tokenizer, load_tokenizer

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_", "im_end|>"]
PIECES = ["hello", " world", "  ", "\n", "\n\n", "\t", "é", "wörld", "你好", "😀", "👨‍👩‍👧", "'s", " 's", "123",
          "4567", "  x", "!!", "\r\n", " ", "def f(x):\n    return x", "\u00a0", "\u200b"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


def _text(r: random.Random, n: int) -> str:
    return "".join(r.choice(PIECES + SPECIAL if r.random() < 0.1 else PIECES) for _ in range(n))


def _whole(tok: Tokenizer, messages) -> list[int]:
    return list(tok.hf.encode(tok.render_chat(messages), add_special_tokens=False))


def test_the_cache_is_built_for_smollm2(tok):
    assert isinstance(tok.segments, SegmentCache)


def test_random_conversations_encode_exactly_as_the_whole_text(tok):
    r = random.Random(11)
    for trial in range(40):
        messages = [{"role": r.choice(["system", "user", "assistant"]), "content": _text(r, r.randint(0, 400))}
                    for _ in range(r.randint(1, 6))]
        assert tok.apply_chat_template(messages, cache_scope=("t", None)) == _whole(tok, messages), trial
        assert tok.apply_chat_template(messages, cache_scope=("t", None)) == _whole(tok, messages), trial  # cached


def test_a_session_reuses_its_earlier_messages_and_scopes_stay_apart(tok):
    seg = tok.segments
    seg.clear()
    r = random.Random(5)

    def plain(n: int) -> str:  # no special token inside: one piece per message
        return "".join(r.choice(PIECES) for _ in range(n))
    messages = [{"role": "user", "content": plain(300)}]
    for turn in range(6):
        assert tok.apply_chat_template(messages, cache_scope=("tenant-a", None)) == _whole(tok, messages)
        if turn < 5:
            messages = messages + [{"role": "assistant", "content": plain(300)}, {"role": "user", "content": plain(300)}]
    # each turn encoded only its two new messages and took the earlier ones from the cache
    assert (seg.hits, seg.misses) == (0 + 1 + 3 + 5 + 7 + 9, 1 + 2 * 5)
    # another tenant, or the same tenant with another cache salt, sends the same conversation: all misses
    for scope in (("tenant-b", None), ("tenant-a", "salt")):
        before = seg.hits
        assert tok.apply_chat_template(messages, cache_scope=scope) == _whole(tok, messages)
        assert seg.hits == before


def test_the_cache_is_bounded(tok):
    seg = SegmentCache(tok.hf._tokenizer, tok.segments.added, min_cached_chars=10, max_cached_chars=1000)
    r = random.Random(2)
    for _ in range(50):
        text = "<|im_start|>user\n" + _text(r, 60) + "<|im_end|>"
        assert seg.encode(text, "s") == list(tok.hf._tokenizer.encode(text, add_special_tokens=False).ids)
        assert seg._cached_chars <= 1000
    assert len(seg._cache) > 0
