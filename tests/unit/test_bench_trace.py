"""Trace conversion for `cpd bench`: token blocks, lengths, truncation, arrivals, reuse classes."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cpd.bench.trace import (BlockTokens, TraceConfig, TraceRow, Vocab, arrival_times, block_lengths,
                             build_requests, load_mooncake, load_requests, vocab_from_model_card)
from tests.conftest import TRACE

V = Vocab(1000, (0, 1, 2, 999))


def row(ts, n_in, n_out, hids, line=0):
    return TraceRow(float(ts), n_in, n_out, tuple(hids), line)


def test_same_hash_id_same_tokens_in_any_order():
    a, b = BlockTokens(V, seed=7), BlockTokens(V, seed=7)
    ids = [5, 0, 123456, 42, 9]
    first = {h: a(h) for h in ids}
    second = {h: b(h) for h in reversed(ids)}
    assert first == second
    assert all(len(v) == 512 for v in first.values())
    assert first[5] != first[42]
    # a partial block is a prefix of the full block
    assert BlockTokens(V, seed=7)(42, 37) == first[42][:37]


def test_seed_determinism_and_sensitivity():
    assert BlockTokens(V, seed=3)(11) == BlockTokens(V, seed=3)(11)
    assert BlockTokens(V, seed=3)(11) != BlockTokens(V, seed=4)(11)
    # the bounded cache does not change results
    small = BlockTokens(V, seed=3, cache_blocks=1)
    assert [small(h) for h in (1, 2, 1)] == [BlockTokens(V, seed=3)(h) for h in (1, 2, 1)]


def test_no_special_ids_and_in_range():
    v = Vocab(40, tuple(range(0, 40, 3)))
    toks = np.array(sum((BlockTokens(v, seed=1)(h) for h in range(50)), []))
    assert toks.min() >= 0 and toks.max() < 40
    assert not set(toks.tolist()) & set(v.special_ids)
    # roughly uniform over the allowed ids: every allowed id shows up
    assert set(toks.tolist()) == set(v.allowed().tolist())
    with pytest.raises(ValueError):
        Vocab(3, (0, 1, 2)).allowed()


def test_block_lengths_rule():
    assert block_lengths(1000, 2, 512) == [512, 488]
    assert block_lengths(1000, 2, 16) == [16, round(488 * 16 / 512)]
    assert block_lengths(513, 2, 16) == [16, 1]  # 1*16/512 rounds to 0 -> clamped to 1
    assert block_lengths(512 + 16, 2, 16) == [16, 1]  # 0.5 rounds half up
    assert block_lengths(512 * 3, 3, 8) == [8, 8, 8]
    with pytest.raises(ValueError):
        block_lengths(2000, 2, 16)  # last block would be 1488 > 512
    with pytest.raises(ValueError):
        block_lengths(100, 1, 0)


def test_shared_hash_prefix_gives_shared_token_prefix():
    rows = [row(0, 512 * 3 + 100, 5, [0, 1, 2, 3], 0), row(0, 512 * 2 + 7, 5, [0, 1, 9], 1),
            row(0, 512 * 4, 5, [0, 4, 5, 6], 2)]
    for tph in (512, 16, 3):
        r0, r1, r2 = build_requests(rows, V, seed=5, tokens_per_hash_id=tph)
        p0, p1, p2 = r0.prompt, r1.prompt, r2.prompt
        assert p0[:2 * tph] == p1[:2 * tph]
        assert p0[2 * tph: 3 * tph] != p1[2 * tph: 3 * tph] or len(p1) == 2 * tph
        assert p0[:tph] == p2[:tph] and p0[tph:2 * tph] != p2[tph:2 * tph]
        bt = BlockTokens(V, seed=5)
        assert p1[2 * tph:] == bt(9, r1.block_lens[-1])
        if tph == 512:
            assert [len(p0), len(p1), len(p2)] == [512 * 3 + 100, 512 * 2 + 7, 512 * 4]


def test_lengths_on_real_trace_slice():
    rows = load_mooncake(TRACE, 0, 50)
    assert len(rows) == 50 and rows[0].line == 0
    for tph in (512, 16):
        reqs = build_requests(rows, V, tokens_per_hash_id=tph)
        for r, q in zip(rows, reqs):
            n = len(r.hash_ids)
            last = r.input_length - 512 * (n - 1)
            assert q.block_lens == [tph] * (n - 1) + [max(1, math.floor(last * tph / 512 + 0.5))]
            assert q.prompt_len == len(q.prompt) == sum(q.block_lens)
            assert q.max_tokens == r.output_length
            if tph == 512:
                assert q.prompt_len == r.input_length


def test_max_prompt_tokens_truncates_whole_trailing_blocks():
    rows = [row(0, 512 * 4 + 10, 5, [0, 1, 2, 3, 4]), row(0, 512 * 2, 5, [0, 1], 1)]
    full = build_requests(rows, V, tokens_per_hash_id=16)
    cut = build_requests(rows, V, tokens_per_hash_id=16, max_prompt_tokens=40)
    assert cut[0].block_lens == [16, 16] and cut[0].hash_ids == [0, 1] and cut[0].truncated
    assert cut[0].prompt == full[0].prompt[:32]
    assert cut[1].prompt == full[1].prompt and not cut[1].truncated
    tiny = build_requests(rows, V, tokens_per_hash_id=16, max_prompt_tokens=5)
    assert tiny[0].prompt == full[0].prompt[:5]
    # context_len caps prompt + output (output_length 5): 60 - 5 = 55 -> 3 whole blocks
    ctx = build_requests(rows, V, tokens_per_hash_id=16, context_len=60)
    assert ctx[0].block_lens == [16, 16, 16] and ctx[1].prompt == full[1].prompt
    both = build_requests(rows, V, tokens_per_hash_id=16, context_len=60, max_prompt_tokens=20)
    assert both[0].block_lens == [16] and both[1].block_lens == [16]


def test_arrival_times_scale_and_spread():
    ts = [0, 0, 0, 3000, 3000, 4000]
    assert arrival_times(ts) == [0, 0, 0, 3, 3, 4]
    assert arrival_times(ts, time_scale=2) == [0, 0, 0, 1.5, 1.5, 2]
    sp = arrival_times(ts, spread_ticks=True)
    assert sp == pytest.approx([0, 1, 2, 3, 3.5, 4])  # 2nd tick capped by the 1 s gap to the next
    assert arrival_times([5000, 5000], spread_ticks=True) == pytest.approx([0, 1.5])
    assert sp == sorted(sp)
    with pytest.raises(ValueError):
        arrival_times([1, 0])
    with pytest.raises(ValueError):
        arrival_times([0], time_scale=0)


def _naive_reuse(lines):
    """Reuse ratio = tokens of the leading run of already-seen blocks / prompt tokens."""
    seen, out = set(), []
    for d in lines:
        h, n = d["hash_ids"], d["input_length"]
        k = 0
        while k < len(h) and h[k] in seen:
            k += 1
        out.append(min(512 * k, n) / n)
        seen.update(h)
    return out


def test_reuse_and_class_on_real_trace():
    with open(TRACE) as f:
        lines = [json.loads(next(f)) for _ in range(50)]
    reqs = build_requests(load_mooncake(TRACE, 0, 50), V, tokens_per_hash_id=4)
    expect = _naive_reuse(lines)
    assert [q.reuse for q in reqs] == pytest.approx(expect)
    assert reqs[0].reuse == 0 and reqs[1].reuse == pytest.approx(512 / lines[1]["input_length"])  # only block 0 is shared
    assert [q.trace_class for q in reqs] == ["warm" if x >= 0.5 else "cold" for x in expect]
    assert {q.id for q in reqs} == {f"r{i}" for i in range(50)}
    strict = build_requests(load_mooncake(TRACE, 0, 50), V, tokens_per_hash_id=4, warm_threshold=0.05)
    assert sum(q.trace_class == "warm" for q in strict) > sum(q.trace_class == "warm" for q in reqs)
    # a `start` offset replays consecutive rows; reuse counts only rows replayed before
    sl = build_requests(load_mooncake(TRACE, 20, 30), V, tokens_per_hash_id=4)
    assert [q.line for q in sl] == list(range(20, 50)) and sl[0].reuse == 0
    assert [q.reuse for q in sl] == pytest.approx(_naive_reuse(lines[20:]))
    assert [q.prompt for q in sl[:3]] == [q.prompt for q in reqs[20:23]]  # tokens do not depend on start


def test_load_requests_and_model_card():
    cfg = TraceConfig(trace=str(TRACE), start=0, max_requests=12, tokens_per_hash_id=8, time_scale=10,
                      spread_ticks=True)
    v = vocab_from_model_card({"id": "m", "metadata": {"vocab_size": 500, "special_token_ids": [0, 7]}})
    assert v == Vocab(500, (0, 7), "model_card:m")
    assert vocab_from_model_card({"id": "m", "object": "model"}) is None
    reqs = load_requests(cfg, v)
    assert len(reqs) == 12 and cfg.vocab_size == 500 and cfg.n_special_ids == 2
    assert reqs[10].arrival_s == pytest.approx(0.3)  # 3 s tick / time_scale 10
    assert 0 < reqs[1].arrival_s < reqs[9].arrival_s < 0.3  # spread within the first tick


def test_bad_rows_rejected(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_mooncake(p)


def test_max_output_tokens_caps_max_tokens_only():
    from cpd.bench.trace import TraceRow, Vocab, build_requests
    rows = [TraceRow(line=0, timestamp_ms=0, input_length=600, output_length=300, hash_ids=[0, 1]),
            TraceRow(line=1, timestamp_ms=0, input_length=600, output_length=5, hash_ids=[0, 2])]
    capped = build_requests(rows, Vocab(1000, ()), tokens_per_hash_id=16, max_output_tokens=32)
    plain = build_requests(rows, Vocab(1000, ()), tokens_per_hash_id=16)
    assert [r.max_tokens for r in capped] == [32, 5] and [r.max_tokens for r in plain] == [300, 5]
    assert [r.block_lens for r in capped] == [r.block_lens for r in plain]
