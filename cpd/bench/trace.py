"""Mooncake-format trace loading and conversion to token-id prompts.

Follows the replay convention in ``shared/data/traces/README.md``:

* every hash id ``h`` (one 512-token block of the original prompt) becomes a deterministic block
  of token ids, ``tokens(h)``, drawn uniformly from the vocabulary minus the special ids by a PRNG
  seeded with ``(seed, h)`` (numpy ``default_rng([seed, h])``), so the block does not depend on the
  order in which ids are first seen;
* a partial last block uses the first ``k`` tokens of ``tokens(h)``;
* the prompt is the concatenation of the blocks and is sent as token ids;
* arrival = ``timestamp / 1000 / time_scale`` seconds; load is scaled by stretching time, never by
  dropping requests; over-long prompts are truncated by whole trailing blocks.

For CPU runs ``tokens_per_hash_id`` (``tph``) shrinks every block: a request with ``n`` hash ids
gets ``[tph] * (n - 1) + [max(1, round(last_len * tph / 512))]`` tokens, where
``last_len = input_length - 512 * (n - 1)`` and ``round`` rounds halves up.
With ``tph == 512`` this is exactly the trace's ``input_length``.

Each request also carries its *trace-side reuse*: the fraction of its (kept) hash ids that appeared
in any earlier replayed request. Reuse ``>= warm_threshold`` (default 0.5) makes the request's
*trace class* ``"warm"``, otherwise ``"cold"``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

#: Tokens per hash id in the Mooncake traces.
TRACE_BLOCK = 512
#: Width of the Mooncake conversation trace's timestamp quantisation (milliseconds).
DEFAULT_TICK_MS = 3000.0


@dataclass(frozen=True)
class TraceRow:
    """One line of a Mooncake JSONL trace.

    ``timestamp_ms``: arrival in ms from trace start; ``input_length`` / ``output_length``: token
    counts; ``hash_ids``: one id per 512-token block (the last one partial); ``line``: 0-based line
    number in the file.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0


@dataclass
class BenchRequest:
    """A request ready to replay.

    * ``id``: ``"r<line>"`` (trace line number, stable across ``start`` offsets);
    * ``arrival_s``: scheduled send offset in seconds from the start of the replay (first replayed
      request at 0);
    * ``prompt``: token ids, generated on access (``len(prompt) == prompt_len``);
    * ``max_tokens``: the trace's ``output_length``;
    * ``hash_ids``: the hash ids kept after truncation (one per replayed block);
    * ``block_lens``: tokens per replayed block (sums to ``prompt_len``);
    * ``reuse``: fraction of ``hash_ids`` seen in earlier replayed requests (0..1);
    * ``trace_class``: ``"warm"`` or ``"cold"``.
    """

    id: str
    line: int
    arrival_s: float
    max_tokens: int
    hash_ids: list[int]
    block_lens: list[int]
    input_length: int
    reuse: float
    trace_class: str
    blocks: "BlockTokens" = field(repr=False, compare=False)
    truncated: bool = False

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens (``sum(block_lens)``)."""
        return sum(self.block_lens)

    @property
    def prompt(self) -> list[int]:
        """Prompt token ids, built on demand (not stored, so a full-trace replay stays small)."""
        out: list[int] = []
        for h, n in zip(self.hash_ids, self.block_lens):
            out.extend(self.blocks(h, n))
        return out


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
    """``tokens(h)``: the deterministic token block of hash id ``h``.

    ``BlockTokens(vocab, seed)(h, k)`` returns the first ``k`` (default 512) ids of the block as a
    list of ints. The full 512-id block is always drawn from ``default_rng([seed, h])`` and then
    sliced, so a partial or shrunk block is a prefix of the full one and the result never depends on
    call order. Up to ``cache_blocks`` blocks are memoised (2 KiB each, int32; oldest dropped first).
    """

    def __init__(self, vocab: Vocab, seed: int = 0, block: int = TRACE_BLOCK, cache_blocks: int = 65536):
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


def load_mooncake(path: str | Path, start: int = 0, max_requests: int | None = None) -> list[TraceRow]:
    """Read ``max_requests`` consecutive rows of a Mooncake JSONL trace, beginning at row ``start``.

    Blank lines are skipped (they do not count as rows). Raises ``ValueError`` (with the line
    number) for a row whose ``hash_ids`` do not fit ``input_length`` (last block outside (0, 512]).
    """
    rows: list[TraceRow] = []
    with open(path, encoding="utf-8") as f:
        idx = -1
        for lineno, text in enumerate(f):
            if not text.strip():
                continue
            idx += 1
            if idx < start:
                continue
            if max_requests is not None and len(rows) >= max_requests:
                break
            d = json.loads(text)
            row = TraceRow(timestamp_ms=float(d["timestamp"]), input_length=int(d["input_length"]),
                           output_length=int(d["output_length"]),
                           hash_ids=tuple(int(h) for h in d["hash_ids"]), line=idx)
            n = len(row.hash_ids)
            last = row.input_length - TRACE_BLOCK * (n - 1)
            if n == 0 or not 0 < last <= TRACE_BLOCK:
                raise ValueError(f"{path}:{lineno + 1}: {n} hash ids do not fit input_length "
                                 f"{row.input_length} (last block {last} tokens)")
            rows.append(row)
    return rows


def block_lengths(input_length: int, n_blocks: int, tokens_per_hash_id: int = TRACE_BLOCK) -> list[int]:
    """Replayed block sizes of a request with ``n_blocks`` hash ids (see module docstring)."""
    tph = tokens_per_hash_id
    if not 1 <= tph <= TRACE_BLOCK:
        raise ValueError(f"tokens_per_hash_id must be in [1, {TRACE_BLOCK}], got {tph}")
    last = input_length - TRACE_BLOCK * (n_blocks - 1)
    if n_blocks <= 0 or not 0 < last <= TRACE_BLOCK:
        raise ValueError(f"{n_blocks} blocks do not fit input_length {input_length}")
    scaled_last = max(1, (2 * last * tph + TRACE_BLOCK) // (2 * TRACE_BLOCK))  # round half up
    return [tph] * (n_blocks - 1) + [scaled_last]


def arrival_times(timestamps_ms: Sequence[float], time_scale: float = 1.0, spread_ticks: bool = False,
                  tick_ms: float = DEFAULT_TICK_MS) -> list[float]:
    """Arrival offsets in seconds, relative to the first timestamp.

    ``arrival = (timestamp - first) / 1000 / time_scale``. With ``spread_ticks`` the ``m`` requests
    sharing one timestamp ``t`` get ``t + i * w / m`` (``i = 0..m-1``), where ``w`` is ``tick_ms``
    capped by the gap to the next distinct timestamp, so order is preserved. Timestamps must be
    non-decreasing; ``time_scale`` > 1 compresses time (more load).
    """
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    ts = [float(t) for t in timestamps_ms]
    if any(b < a for a, b in zip(ts, ts[1:])):
        raise ValueError("timestamps must be non-decreasing")
    if spread_ticks and ts:
        out = list(ts)
        i = 0
        while i < len(ts):
            j = i
            while j < len(ts) and ts[j] == ts[i]:
                j += 1
            width = tick_ms if j == len(ts) else min(tick_ms, ts[j] - ts[i])
            m = j - i
            for k in range(m):
                out[i + k] = ts[i] + k * width / m
            i = j
        ts = out
    t0 = ts[0] if ts else 0.0
    return [(t - t0) / 1000.0 / time_scale for t in ts]


def build_requests(rows: Sequence[TraceRow], vocab: Vocab, *, seed: int = 0,
                   tokens_per_hash_id: int = TRACE_BLOCK, max_prompt_tokens: int | None = None,
                   time_scale: float = 1.0, spread_ticks: bool = False,
                   tick_ms: float = DEFAULT_TICK_MS, warm_threshold: float = 0.5,
                   context_len: int | None = None,
                   max_output_tokens: int | None = None) -> list[BenchRequest]:
    """Turn trace rows into replayable requests (prompts, arrivals, reuse and trace class).

    ``max_prompt_tokens`` drops whole trailing blocks until the prompt fits; if even the first
    block does not fit, the prompt is the first ``max_prompt_tokens`` ids of that block.
    ``context_len`` (the model's context, e.g. ``max_model_len``) additionally caps each prompt at
    ``context_len - output_length`` tokens (at least 1), the same way, so prompt plus output fits.
    Reuse is computed over the kept hash ids against all hash ids kept by earlier rows of ``rows``.
    ``max_output_tokens`` caps ``max_tokens`` (default: the trace's ``output_length``) for runs
    on small machines where decode, not prefill, would otherwise dominate; record it with results.
    """
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError("max_prompt_tokens must be >= 1")
    if context_len is not None and context_len < 2:
        raise ValueError("context_len must be >= 2")
    blocks = BlockTokens(vocab, seed)
    arrivals = arrival_times([r.timestamp_ms for r in rows], time_scale, spread_ticks, tick_ms)
    seen: set[int] = set()
    out: list[BenchRequest] = []
    for row, arr in zip(rows, arrivals):
        lens = block_lengths(row.input_length, len(row.hash_ids), tokens_per_hash_id)
        hids = list(row.hash_ids)
        truncated = False
        cap = max_prompt_tokens
        if context_len is not None:
            ctx_cap = max(1, context_len - _out_len(row, max_output_tokens))
            cap = ctx_cap if cap is None else min(cap, ctx_cap)
        if cap is not None and sum(lens) > cap:
            truncated = True
            total, keep = 0, 0
            for n in lens:
                if total + n > cap:
                    break
                total += n
                keep += 1
            if keep == 0:
                lens, hids = [cap], hids[:1]
            else:
                lens, hids = lens[:keep], hids[:keep]
        hits = sum(1 for h in hids if h in seen)
        reuse = hits / len(hids)
        seen.update(hids)
        out.append(BenchRequest(
            id=f"r{row.line}", line=row.line, arrival_s=arr, blocks=blocks,
            max_tokens=_out_len(row, max_output_tokens), hash_ids=hids, block_lens=lens,
            input_length=row.input_length, reuse=reuse,
            trace_class="warm" if reuse >= warm_threshold else "cold", truncated=truncated))
    return out


def _out_len(row: TraceRow, max_output_tokens: int | None) -> int:
    return row.output_length if max_output_tokens is None else min(row.output_length, max_output_tokens)


@dataclass
class TraceConfig:
    """All knobs of a trace conversion, as recorded in results JSON."""

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
