"""The engine's step scheduler: a pure function of a snapshot (docs/architecture.md).

Used unchanged by the live engine (``cpd.engine.engine``) and by the simulator
(``cpd.sim``). No I/O, no clock, no threads.

Model (after vLLM v1's unified scheduler, ``vllm/v1/core/sched/scheduler.py``):
every sequence has ``num_tokens`` (prompt + generated so far) and
``num_computed_tokens`` (tokens whose KV is already in the pool, computed or
loaded). Each step gives each scheduled sequence ``num_new_tokens`` to compute:
a prefill chunk, or 1 for a decoding sequence. There is no separate prefill/decode
phase: chunked prefill and continuous-batching decode fall out of one rule.

Rules, in order:

1. Running sequences first, in admission order (FCFS). Each gets
   ``min(num_tokens - num_computed_tokens, max_prefill_chunk_tokens, budget left)``.
2. A running sequence that needs a new block when none is free preempts the most
   recently admitted running sequence (recompute preemption); if it is itself the
   newest, it is preempted. A preempted sequence frees only the blocks no one else
   holds (``freeable_blocks``): a prefix block shared with another sequence stays in use.
3. Waiting sequences are admitted FCFS while the token budget, ``max_num_seqs``
   and free blocks allow. A waiting sequence that does not fit stops admission
   (no overtaking: it keeps FCFS fairness, as vLLM does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

# A sequence id: the engine's request ids are str, the simulator's are request indices.
RequestId = TypeVar("RequestId", str, int)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    Attributes:
        max_num_batched_tokens: token budget per step (prefill chunks + decodes).
        max_num_seqs: most sequences running at once.
        max_prefill_chunk_tokens: most prompt tokens of one sequence per step (chunked prefill).
        block_size: tokens per KV block.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_prefill_chunk_tokens: int = 512
    block_size: int = 16


@dataclass(frozen=True)
class SeqState(Generic[RequestId]):
    """Snapshot of one sequence.

    Attributes:
        request_id: unique id.
        num_tokens: prompt tokens + output tokens so far (all must end up in KV).
        num_computed_tokens: tokens whose KV is in the pool (computed or loaded).
        num_allocated_blocks: KV blocks the sequence holds now (cached prefix included).
    """

    request_id: RequestId
    num_tokens: int
    num_computed_tokens: int
    num_allocated_blocks: int


@dataclass(frozen=True)
class ScheduledSeq(Generic[RequestId]):
    request_id: RequestId
    num_new_tokens: int
    num_new_blocks: int


@dataclass(frozen=True)
class SchedulePlan(Generic[RequestId]):
    """The step's decision.

    Attributes:
        scheduled: sequences to run this step, running ones first, then newly admitted.
        admitted: ids of waiting sequences admitted this step (a subset of ``scheduled``).
        preempted: running sequences to preempt (free their blocks, requeue at the front).
        num_batched_tokens: sum of ``num_new_tokens``.
    """

    scheduled: tuple[ScheduledSeq[RequestId], ...]
    admitted: tuple[RequestId, ...]
    preempted: tuple[RequestId, ...]
    num_batched_tokens: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


def _chunk(seq: SeqState, budget: int, cfg: SchedulerConfig) -> int:
    return max(0, min(seq.num_tokens - seq.num_computed_tokens, cfg.max_prefill_chunk_tokens, budget))


def _new_blocks(seq: SeqState, n: int, cfg: SchedulerConfig) -> int:
    return max(0, blocks_for(seq.num_computed_tokens + n, cfg.block_size) - seq.num_allocated_blocks)


def schedule(running: Sequence[SeqState[RequestId]], waiting: Sequence[SeqState[RequestId]], num_free_blocks: int,
             cfg: SchedulerConfig, freeable_blocks: Callable[[RequestId], int] | None = None
             ) -> SchedulePlan[RequestId]:
    """Decide one engine step.

    Args:
        running: admitted sequences in admission order.
        waiting: queued sequences in arrival order (``num_computed_tokens`` already
            counts a cached prefix; ``num_allocated_blocks`` its blocks).
        num_free_blocks: blocks that can be allocated now (free + evictable).
        cfg: limits.
        freeable_blocks: blocks that preempting a running sequence makes allocatable: those
            it holds alone (a shared prefix block stays in use). None: all its blocks (no
            block is shared). Asked only for the sequences it preempts.
    Returns:
        A :class:`SchedulePlan`. Never schedules more than ``cfg.max_num_batched_tokens``
        tokens or allocates more than ``num_free_blocks`` blocks plus what the preempted
        sequences free. (Blocks two preempted sequences share are counted as freed by
        neither: conservative, never more than the pool has.)
    """
    def freed(seq: SeqState[RequestId]) -> int:
        return seq.num_allocated_blocks if freeable_blocks is None else freeable_blocks(seq.request_id)

    budget = cfg.max_num_batched_tokens
    free = num_free_blocks
    out: list[ScheduledSeq[RequestId]] = []
    preempted: list[RequestId] = []
    live = list(running)
    i = 0
    while i < len(live):
        seq = live[i]
        n = _chunk(seq, budget, cfg)
        if n == 0:
            i += 1
            continue
        need = _new_blocks(seq, n, cfg)
        while need > free and live[-1] is not seq:
            victim = live.pop()
            preempted.append(victim.request_id)
            free += freed(victim)
        if need > free:
            live.pop(i)
            preempted.append(seq.request_id)
            free += freed(seq)
            continue
        free -= need
        budget -= n
        out.append(ScheduledSeq(seq.request_id, n, need))
        i += 1
    admitted: list[RequestId] = []
    num_seqs = len(live)
    for seq in waiting:
        if num_seqs >= cfg.max_num_seqs or budget <= 0:
            break
        n = _chunk(seq, budget, cfg)
        need = _new_blocks(seq, n, cfg)
        if n == 0 or need > free:
            break
        free -= need
        budget -= n
        num_seqs += 1
        out.append(ScheduledSeq(seq.request_id, n, need))
        admitted.append(seq.request_id)
    return SchedulePlan(tuple(out), tuple(admitted), tuple(preempted),
                        cfg.max_num_batched_tokens - budget)
