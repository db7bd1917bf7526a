"""Contiguous per-sequence KV rows for the sequences a step *continues* (decode rows and
chunks on a cached prefix), so that attention reads a view instead of gathering every
block of every sequence each step.

The paged pool (``[L, 2, num_blocks, block_size, H, D]``) stays the source of truth: prefix
caching, L2/L3, export and the handoff read and write only the pool, and every forward
still writes each new token's K/V there. The arena is a *mirror*:
``buf [L, 2, rows, H, capacity_tokens, D]`` (zero-initialised, **head-major**: each head's
tokens are contiguous, the ``[batch, heads, len, d]`` layout the fused attention kernels
stream; a token-major row made the CPU kernel read every head's cache lines once per head,
≈ 3× the memory traffic at 3 KV heads).

Rules:

* A sequence gets a row when the step continues it later or now: a one-token (decode) row,
  a chunk on top of ``num_prior > 0`` cached tokens, or a first chunk that more chunks will
  follow. A fresh prefill done in one step gets none (its attention reads its own new K/V).
* A row is *valid* for a sequence iff it was filled for the same token list object (the
  arena holds a reference, so the identity cannot be reused while the row lives), holds
  exactly ``num_prior`` tokens, and was filled from the same block ids. An invalid or new
  row is refilled from the pool once (one gather of the prefix); afterwards each step
  appends only the step's new tokens (written by the model next to the pool write).
* A sequence absent from a step loses its row (preemption, finish, abort, a prefill-only
  step in between: the next use refills from the pool). A step with no such sequence, and an
  idle engine, forget every row but keep the storage (at most ``max_bytes``): allocating it
  afresh costs a page fault per page (0.2 s for one 6 K-token SmolLM2 row in float32, more
  than copying the prefix into it), which every warm request on a prefill worker would pay.
  :meth:`reset` releases it.
* Capacity covers every token known of the row's sequences (a chunked prompt's later chunks
  included). A new storage is sized by the step's need (×2 along a dimension that grew,
  tokens rounded to whole blocks; at most 4× the need), the kept rows moved into it. When
  the storage a step needs would exceed ``max_bytes`` the arena is released and the step
  returns None: the model then gathers from the pool as before (correct, slower).
  :attr:`nbytes` is the memory held now, :attr:`peak_bytes` the most ever held.
* After a failed forward call :meth:`reset` (rows may hold a partial step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass
class ArenaStep:
    """What one step reads and writes in the arena (built by :meth:`SeqKVArena.plan`).

    Attributes:
        buf: ``[L, 2, rows_cap, H, capacity_tokens, D]`` storage (head-major).
        rows: per sequence of the step, its row or None (no row: pool gather / own K/V).
    """

    buf: torch.Tensor
    rows: list[int | None]


@dataclass
class _Row:
    token_ids: Any  # the sequence's token list (identity; kept alive while the row lives)
    num_tokens: int
    blocks: list[int] = field(default_factory=list)  # blocks covering num_tokens


def wants_row(num_prior: int, num_new: int, num_tokens_known: int) -> bool:
    """Whether a sequence continues beyond or on top of this step (see module rules)."""
    return num_new == 1 or num_prior > 0 or num_prior + num_new < num_tokens_known


class SeqKVArena:
    """See the module docstring.

    Args:
        dtype / device: of the KV (the pool's).
        max_bytes: cap on the storage; None = the pool's size (``kv.nbytes``) at first use.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, max_bytes: int | None = None):
        self.dtype, self.device = dtype, device
        self.max_bytes = max_bytes
        self.buf: torch.Tensor | None = None
        self._rows: dict[int, _Row] = {}  # row -> state
        self._by_seq: dict[int, int] = {}  # id(token_ids) -> row
        self.peak_bytes = 0
        self.num_refills = 0  # rows (re)filled from the pool
        self.num_row_steps = 0  # (row, step) pairs served: what the pool gather would have copied
        self.num_fallbacks = 0  # steps over max_bytes (pool gather)

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()

    def reset(self) -> None:
        """Forget every row and release the storage."""
        self.buf = None
        self.forget()

    def forget(self) -> None:
        """Forget every row; keep the storage for the next rows."""
        self._rows.clear()
        self._by_seq.clear()

    def plan(self, seqs: Sequence[Any], kv: torch.Tensor) -> ArenaStep | None:
        """Assign, validate, (re)fill and grow rows for a step over ``seqs`` (objects with
        ``num_computed``, ``num_new``, ``blocks``, ``token_ids``; e.g.
        :class:`~cpd.engine.executor.ForwardSeq`) on the pool ``kv``. None: no sequence
        wants a row, or the storage would exceed ``max_bytes`` (rows forgotten)."""
        want = [wants_row(s.num_computed, s.num_new, len(s.token_ids)) for s in seqs]
        if not any(want):
            self.forget()
            return None
        bs = kv.shape[3]
        keep: dict[int, int] = {}
        for s, w in zip(seqs, want):
            if w:
                row = self._by_seq.get(id(s.token_ids))
                if row is not None and self._valid(self._rows[row], s, bs):
                    keep[id(s.token_ids)] = row
        for key in [k for k in self._by_seq if k not in keep]:  # absent or invalid: drop
            del self._rows[self._by_seq.pop(key)]
        # room for every token known now (a chunked prompt's later chunks: one allocation)
        need_tokens = max(max(s.num_computed + s.num_new, len(s.token_ids)) for s, w in zip(seqs, want) if w)
        need_rows = sum(want)
        if not self._ensure(need_rows, need_tokens, bs, kv):
            self.num_fallbacks += 1
            self.reset()
            return None
        assert self.buf is not None  # _ensure allocated it
        rows: list[int | None] = []
        free = iter(sorted(set(range(need_rows)) - set(self._rows)))
        for s, w in zip(seqs, want):
            if not w:
                rows.append(None)
                continue
            key = id(s.token_ids)
            row = self._by_seq.get(key)
            if row is None:
                row = next(free)
                self._by_seq[key] = row
                self._rows[row] = _Row(s.token_ids, 0)
                if s.num_computed:
                    self._fill(row, s, kv)
            st = self._rows[row]
            st.num_tokens = s.num_computed + s.num_new
            st.blocks = list(s.blocks[:-(-st.num_tokens // bs)])
            rows.append(row)
        self.num_row_steps += need_rows
        return ArenaStep(self.buf, rows)

    def _valid(self, st: _Row, s: Any, bs: int) -> bool:
        return st.token_ids is s.token_ids and st.num_tokens == s.num_computed and \
            st.blocks == list(s.blocks[:len(st.blocks)]) and len(st.blocks) == -(-s.num_computed // bs)

    def _ensure(self, need_rows: int, need_tokens: int, bs: int, kv: torch.Tensor) -> bool:
        """Make the storage hold ``need_rows`` × ``need_tokens`` (False: over the cap).

        A new storage is sized by this step's need, never by the old storage's other
        dimension: rows ×2 and tokens ×2 only along a dimension that grew (so a batch that
        grows one sequence at a time reallocates O(log n) times), at most 4× the need, and
        never more rows than needed when only the tokens grew. (Keeping the old row count
        made one long prefill after a wide decode batch allocate and zero rows × tokens of
        a past batch: 8-13 s of page faults in one step at 32 rows, SmolLM2.) The kept rows
        move to rows ``0 .. k-1`` with their tokens; the others start zeroed."""
        L, two, _, _, H, D = kv.shape
        cap = self.max_bytes if self.max_bytes is not None else kv.numel() * kv.element_size()
        per_token = L * two * H * D * kv.element_size()
        old = self.buf
        r0, t0 = (old.shape[2], old.shape[4]) if old is not None else (0, 0)
        if need_rows <= r0 and need_tokens <= t0:
            return True
        exact = (need_rows, -(-need_tokens // bs) * bs)
        grown = (max(need_rows, 2 * r0) if need_rows > r0 else need_rows,
                 -(-max(need_tokens, 2 * t0) // bs) * bs if need_tokens > t0 else exact[1])
        rows, tokens = next((shape for shape in (grown, exact) if shape[0] * shape[1] * per_token <= cap), (0, 0))
        if not rows:
            return False
        buf = torch.zeros(L, two, rows, H, tokens, D, dtype=kv.dtype, device=kv.device)
        new_of = {old_row: new_row for new_row, old_row in enumerate(sorted(self._rows))}
        for old_row, new_row in new_of.items():
            n = self._rows[old_row].num_tokens
            if old is not None and n:
                buf[:, :, new_row, :, :n] = old[:, :, old_row, :, :n]
        self._rows = {new_of[row]: st for row, st in self._rows.items()}
        self._by_seq = {key: new_of[row] for key, row in self._by_seq.items()}
        self.buf = buf
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return True

    def _fill(self, row: int, s: Any, kv: torch.Tensor) -> None:
        """Copy a sequence's ``num_computed`` cached tokens from the pool into its row: one
        strided copy per run of consecutive block ids (blocks are mostly allocated in runs),
        straight into the row: no gathered temporary (at 6 K cached tokens of SmolLM2 the
        temporary was 283 MB, and allocating it cost more than the copy)."""
        assert self.buf is not None
        bs = kv.shape[3]
        n = s.num_computed
        blocks = list(s.blocks[:-(-n // bs)])
        L, two, _, _, H, D = kv.shape
        dst = self.buf[:, :, row]  # [L, 2, H, tokens, D]
        for i, j in _runs(blocks):
            src = kv[:, :, blocks[i]:blocks[i] + (j - i)].reshape(L, two, (j - i) * bs, H, D)
            dst[:, :, :, i * bs:j * bs].copy_(src.transpose(2, 3))
        self.num_refills += 1


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[(i, j), ...]``: the index ranges of ``ids`` whose values are consecutive (+1 each)."""
    out = []
    i = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or ids[k] != ids[k - 1] + 1:
            out.append((i, k))
            i = k
    return out
