"""Mooncake-row API of ``cpd bench`` kept for callers and tests; everything is done by :mod:`cpd.traces`.

``cpd.traces`` holds the one implementation: readers (every format), token blocks
(``tokens(h)`` from ``default_rng([seed, key])``, the shrink rule), the arrival model and the
replay schedule. This module only adapts in-memory Mooncake rows (``TraceRow``) to it.
Reuse is the reuse ratio of docs/architecture.md (Terms): cached prefix tokens / prompt tokens over an infinite cache of
the replayed requests, in the trace's tokens; ``trace_class`` is ``warm`` at ``>= warm_threshold``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from cpd.traces.arrivals import DEFAULT_TICK_MS, arrival_times
from cpd.traces.blocks import BlockTokens, Vocab, shrink, vocab_from_model_card, vocab_from_tokenizer
from cpd.traces.model import Trace, TraceRequest, TraceSession
from cpd.traces.readers import MOONCAKE_BLOCK, iter_mooncake_rows
from cpd.traces.replay import ReplayOptions, ReplayRequest, build_schedule

#: Tokens per hash id in the Mooncake traces.
TRACE_BLOCK = MOONCAKE_BLOCK
#: A replayed request (the same type ``cpd simulate`` converts).
BenchRequest = ReplayRequest


@dataclass(frozen=True)
class TraceRow:
    """One line of a Mooncake JSONL trace (``line``: 0-based row number, blank lines not counted)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0


def load_mooncake(path: str | Path, start: int = 0, max_requests: int | None = None) -> list[TraceRow]:
    """``max_requests`` consecutive rows from row ``start``; ``TraceFormatError`` (a ``ValueError``
    naming file and line) for a malformed row."""
    rows: list[TraceRow] = []
    for idx, (_, r) in enumerate(iter_mooncake_rows(path)):
        if idx < start:
            continue
        if max_requests is not None and len(rows) >= max_requests:
            break
        rows.append(TraceRow(r.t_s * 1000.0, r.input_tokens, r.output_tokens, tuple(r.hash_ids or ()), idx))
    return rows


def block_lengths(input_length: int, n_blocks: int, tokens_per_hash_id: int = TRACE_BLOCK) -> list[int]:
    """Replayed block sizes of a Mooncake request with ``n_blocks`` hash ids."""
    last = input_length - TRACE_BLOCK * (n_blocks - 1)
    if n_blocks <= 0 or not 0 < last <= TRACE_BLOCK:
        raise ValueError(f"{n_blocks} blocks do not fit input_length {input_length}")
    return [shrink(TRACE_BLOCK, TRACE_BLOCK, tokens_per_hash_id)] * (n_blocks - 1) + [
        shrink(last, TRACE_BLOCK, tokens_per_hash_id)]


def build_requests(rows: Sequence[TraceRow], vocab: Vocab, *, seed: int = 0,
                   tokens_per_hash_id: int = TRACE_BLOCK, max_prompt_tokens: int | None = None,
                   time_scale: float = 1.0, spread_ticks: bool = False,
                   tick_ms: float = DEFAULT_TICK_MS, warm_threshold: float = 0.5,
                   context_len: int | None = None,
                   max_output_tokens: int | None = None) -> list[BenchRequest]:
    """Rows → replay requests via :func:`cpd.traces.build_schedule` (ids ``r<line>``)."""
    reqs = [TraceRequest(r.timestamp_ms / 1000.0, r.input_length, r.output_length, tuple(r.hash_ids), f"r{r.line}")
            for r in rows]
    trace = Trace("mooncake", "<rows>", TRACE_BLOCK, [TraceSession("trace", None, reqs)], timed=True,
                  has_prefix_info=True)
    opts = ReplayOptions(tokens_per_block=tokens_per_hash_id, seed=seed, max_prompt_tokens=max_prompt_tokens,
                         time_scale=time_scale, spread_ticks=spread_ticks, tick_ms=tick_ms,
                         cold_threshold=warm_threshold, context_len=context_len, max_output_tokens=max_output_tokens)
    out = build_schedule(trace, opts, vocab)
    for q, r in zip(out, rows):
        q.id, q.line = f"r{r.line}", r.line
    return out


@dataclass
class TraceConfig:
    """All knobs of a Mooncake conversion, as recorded in results JSON."""

    trace: str
    start: int = 0
    max_requests: int | None = None
    seed: int = 0
    tokens_per_hash_id: int = TRACE_BLOCK
    max_prompt_tokens: int | None = None
    time_scale: float = 1.0
    spread_ticks: bool = False
    tick_ms: float = DEFAULT_TICK_MS
    warm_threshold: float = 0.5
    context_len: int | None = None
    max_output_tokens: int | None = None
    vocab_size: int | None = None
    vocab_source: str | None = None
    n_special_ids: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def load_requests(cfg: TraceConfig, vocab: Vocab) -> list[BenchRequest]:
    """``load_mooncake`` + ``build_requests`` with the settings in ``cfg`` (fills its vocab fields)."""
    rows = load_mooncake(cfg.trace, cfg.start, cfg.max_requests)
    cfg.vocab_size, cfg.vocab_source, cfg.n_special_ids = vocab.size, vocab.source, len(vocab.special_ids)
    return build_requests(rows, vocab, seed=cfg.seed, tokens_per_hash_id=cfg.tokens_per_hash_id,
                          max_prompt_tokens=cfg.max_prompt_tokens, time_scale=cfg.time_scale,
                          spread_ticks=cfg.spread_ticks, tick_ms=cfg.tick_ms,
                          warm_threshold=cfg.warm_threshold, context_len=cfg.context_len,
                          max_output_tokens=cfg.max_output_tokens)


__all__ = ["TRACE_BLOCK", "DEFAULT_TICK_MS", "TraceRow", "BenchRequest", "Vocab", "BlockTokens",
           "vocab_from_tokenizer", "vocab_from_model_card", "load_mooncake", "block_lengths",
           "arrival_times", "build_requests", "TraceConfig", "load_requests"]
