"""The engine's one seam to the model: an *executor* runs the forward step and samples.

The engine (scheduler, L1 pool, L2 host pool, L3 connector, KV events, handoff) is the same
for every executor; only what happens inside one step differs:

* ``torch`` (:mod:`cpd.engine.executor_torch`, the default): real model math on a paged KV
  tensor; the step takes as long as it takes.
* ``modeled`` (:mod:`cpd.engine.executor_modeled`): no model; the step *waits* for the cost
  model's step time (on the wall clock, or on a virtual clock in the simulator) and yields
  deterministic pseudo tokens; KV payloads are a small fixed fraction of the modeled bytes.

This module has no torch import (a modeled worker never imports torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from cpd.engine.kv_arrays import KVArrays


@dataclass(frozen=True)
class TokenHistory:
    """What sampling may depend on besides the logits: the request's tokens so far
    (``token_ids[:prompt_len]`` the prompt, the rest its output; read-only) and the ids that
    may not be sampled now (the stop ids while ``min_tokens`` is not reached)."""

    token_ids: Sequence[int] = ()
    prompt_len: int = 0
    banned_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ForwardSeq:
    """One sequence's part of a step.

    Attributes:
        num_computed: tokens whose KV exists before this step.
        num_new: tokens computed this step (a prefill chunk, or 1 when decoding).
        blocks: the sequence's L1 block table (already covers ``num_computed + num_new``).
        token_ids: the sequence's tokens so far (prompt + outputs); read-only.
        prompt_len: prompt tokens (tokens past it are outputs being decoded).
    """

    num_computed: int
    num_new: int
    blocks: Sequence[int]
    token_ids: Sequence[int]
    prompt_len: int


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV the pools hold per token: ``[num_layers, 2, ., num_kv_heads, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class Executor(Protocol):
    """What the engine needs from an executor.

    Attributes:
        config: model facts the engine reads: ``vocab_size``, ``max_position_embeddings``,
            ``eos_token_id``, ``eos_token_ids``.
        kv_layout: layout of the KV arrays the pools hold.
        arrays: how those arrays are allocated and copied.
        kv_bytes_per_token: bytes of K+V per token *of the model served* (the modeled model for
            ``modeled``: what transfers and the router's load-vs-recompute estimates count).
        model_id, weights_digest, tokenizer_digest, kv_dtype: namespace parts.
    """

    config: Any
    kv_layout: KVLayout
    kv_bytes_per_token: int
    model_id: str
    weights_digest: str
    tokenizer_digest: str
    kv_dtype: str

    @property
    def arrays(self) -> KVArrays:  # read-only here: an executor may hold a narrower kind (NumpyKVArrays)
        ...

    def payload_bytes(self, model_bytes: int) -> int:
        """Bytes the pools actually hold for ``model_bytes`` of the served model's KV."""

    def forward(self, seqs: Sequence[ForwardSeq], kv: Any, sample_rows: Sequence[int]) -> Any:
        """Run one step over ``seqs`` writing their KV into the pool array ``kv``; return the
        per-row outputs (logits) of the sequences ``sample_rows`` (indices into ``seqs``), or
        None when ``sample_rows`` is empty."""

    def greedy_tokens(self, logits: Any) -> list[int]:
        """Greedy token of every row."""

    def sample_token(self, logits: Any, row: int, params: Any, output_index: int,
                     history: TokenHistory | None = None) -> int:
        """The token of one row under ``params`` (a :class:`~cpd.engine.sampling.SamplingParams`)
        and the request's ``history`` (penalties, banned ids)."""

    def idle(self) -> None:
        """No sequence is running any more: release per-sequence state kept between steps
        (the torch executor's contiguous KV rows)."""

    def transfer(self, tier: str, num_tokens: int) -> None:
        """Account for moving ``num_tokens`` of KV over ``tier``'s link (``L2`` host → device,
        ``L3`` store → device, ``NIC`` handoff); the modeled executor waits the modeled time."""
