"""Batch-invariant model math (``engine.batch_invariant``, ``--batch-invariant``).

The correctness oracle (docs/architecture.md) asks that a request's greedy tokens do not depend on
the path it took. With the ordinary kernels a token row's result depends on the shape of the call
it ran in: a BLAS picks its blocking (and so its summation order) from the number of rows ``M``,
and the fused attention kernel splits queries and keys by their lengths. A prompt's rows therefore
come out differently when the prompt is prefilled in other chunks (a step's token budget shared
with other requests, a cached prefix of another length) or beside other rows (continuous
batching), and so does a token's K/V when a decode step computes it instead of a prefill. In
float32 the difference stays in the last bits; in bfloat16 it is rounded into the activations and
the KV, and it flipped a greedy token in about one chunking in five on the tiny test model (700-token
prompts, 60 tokens out; ``tests/integration/test_batch_invariance.py``).

This mode computes every row with calls whose shapes do not depend on the batch:

- linears run on tiles of exactly :data:`TILE_ROWS` rows (the last tile zero-padded), each on one
  thread, so every call has the same ``M`` and the same split of its sums, and a row's result
  depends on that row alone;
- attention runs over key blocks of :data:`KV_BLOCK` positions counted from position 0. A row at
  position ``t`` sees the blocks before its own whole, through torch's CPU flash kernel in the model
  dtype, called once per block with exactly :data:`KV_BLOCK` keys and the query rows in tiles of
  exactly :data:`FLASH_QUERY_ROWS` (with both lengths fixed its result for a row does not depend
  on the other query rows, nor on the other sequences of the batch: checked by the tests; with
  only the key length fixed it did on an AVX-512 CPU), and its own block up to ``t`` in float32 on tiles of
  :data:`QUERY_TILE` rows with the keys past ``t`` masked. The parts are merged in float32 by their
  log-sum-exps in block order. Which parts a row has, and how each is
  computed, depends on ``t`` alone: so its output does not depend on the chunk, the batch or
  the path (prefill, decode, decode-local append, a handoff's imported prefix).

Its price is compute (padded tiles, more and smaller calls, a gather of each context):
``docs/results/batch_invariant`` measures it. vLLM's batch-invariant mode and SGLang's
deterministic inference do the same with GPU kernels of their own; here it is built from torch's
CPU kernels with the shapes fixed (a CUDA device is not supported: the flash call is the CPU one).
Its KV is a numeric flavour of its own (the ``kv_dtype`` namespace part gets
:data:`KV_DTYPE_SUFFIX`), so it is never mixed with KV computed the ordinary way.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch

#: rows per linear call
TILE_ROWS = 64
#: query rows per attention tile
QUERY_TILE = 16
#: key positions per attention block (blocks start at positions 0, KV_BLOCK, 2 KV_BLOCK, ...)
KV_BLOCK = 128
#: query rows (query heads of a KV head folded in) of every flash call over a whole key block
FLASH_QUERY_ROWS = 64
#: appended to the executor's ``kv_dtype`` (a namespace part) in this mode
KV_DTYPE_SUFFIX = "+batch-invariant"

Linear = Callable[..., torch.Tensor]


def tiled_linear(big: Linear) -> Linear:
    """``big(x, w, b)`` computed on tiles of :data:`TILE_ROWS` rows of ``x``, each on one thread: with
    several threads a BLAS splits the sum over ``K`` among them when a tile's ``M × N`` is small
    beside ``K`` (MKL's sgemm, oneDNN's bf16 gemm), so the bits depended on the thread count
    (SmolLM2-135M's float32 KV differed from layer 1 on between 1 and 2 threads)."""
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        pad = (-m) % TILE_ROWS
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        with _one_thread():
            return torch.cat([big(x[i:i + TILE_ROWS], w, b) for i in range(0, x.shape[0], TILE_ROWS)])[:m]
    return linear


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads set to 1 for the block (the setting is per process; the engine
    thread is the one that runs model math)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           seqs: list[tuple[int, int, torch.Tensor]], num_kv_heads: int) -> torch.Tensor:
    """Causal attention of every sequence's new rows over its context, batch-invariantly.

    Args:
        q: ``[T, nh, d]`` the step's queries (RoPE applied), sequence after sequence.
        k_cache, v_cache: ``[slots, nkv, d]`` the pool's K/V (the step's own already written).
        seqs: per sequence ``(query_start, num_new, context_slots)``; its new rows are the last
            ``num_new`` positions of its context.
        num_kv_heads: ``nkv`` (query head ``h`` reads KV head ``h // (nh / nkv)``).
    Returns:
        ``[T, nh * d]`` in ``q``'s dtype.
    """
    T, nh, d = q.shape
    out = q.new_empty(T, nh * d)
    for qs, n, ctx in seqs:
        if n > 1:
            k, v = k_cache.index_select(0, ctx), v_cache.index_select(0, ctx)
            out[qs:qs + n] = _attend_seq(q[qs:qs + n], k, v, num_kv_heads).to(q.dtype)
    single = [(qs, ctx) for qs, n, ctx in seqs if n == 1]  # decode rows (and one-token chunks)
    if single:
        rows = torch.tensor([qs for qs, _ in single], device=q.device)
        out[rows] = _attend_single_rows(q[rows], k_cache, v_cache, [c for _, c in single],
                                        num_kv_heads).to(q.dtype)
    return out


def _attend_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nkv: int) -> torch.Tensor:
    """One sequence: ``q [n, nh, d]`` at positions ``L - n .. L - 1`` over ``k, v [L, nkv, d]``
    (the model dtype) → ``[n, nh * d]`` float32.

    A row at position ``t`` attends over the key blocks ``0 .. t // KV_BLOCK - 1`` whole (torch's
    CPU flash kernel, one call per block over every row that sees all of it, in tiles of a fixed
    number of query rows (:func:`_flash_block`), so that its result for a row does not depend on
    the other rows) and over its own block
    ``t // KV_BLOCK`` up to ``t`` (:func:`_own_block`, fixed-shape tiles); the parts are merged by
    their log-sum-exps in block order."""
    n, nh, d = q.shape
    L, g = k.shape[0], nh // nkv
    pos0 = L - n  # position of the first row
    qf = q.view(n, nkv, g, d).transpose(0, 1).reshape(1, nkv, n * g, d)  # GQA folded, position-major
    kh, vh = _blocks(k[:(L - 1) // KV_BLOCK * KV_BLOCK]), _blocks(v[:(L - 1) // KV_BLOCK * KV_BLOCK])
    m, den, acc = _state(n, nh, d, q.device)
    for j in range((L - 1) // KV_BLOCK):  # the blocks some row sees whole
        r0 = max(0, (j + 1) * KV_BLOCK - pos0)  # first row past block j
        if r0 >= n:
            continue
        o, lse = _flash_block(qf[:, :, r0 * g:], kh[j][None], vh[j][None])
        _merge(m, den, acc, slice(r0, n), o.reshape(nkv, n - r0, g, d).transpose(0, 1).reshape(n - r0, nh, d),
               lse.reshape(nkv, n - r0, g).transpose(0, 1).reshape(n - r0, nh))
    o, lse = _own_block(q, k, v, pos0, nkv)
    _merge(m, den, acc, slice(0, n), o, lse)
    return acc.div_(den[..., None]).view(n, nh * d)


def _attend_single_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        ctxs: list[torch.Tensor], nkv: int) -> torch.Tensor:
    """Rows that are their sequence's only new token (decode rows), all sequences at once:
    ``q [S, nh, d]`` (the model dtype) at the last position of each context → ``[S, nh * d]`` float32. The same
    parts as :func:`_attend_seq` computes for a row, by calls of the same shapes with the
    sequences as the batch dimension (one call per block index instead of one per sequence)."""
    S, nh, d = q.shape
    g = nh // nkv
    lens = torch.tensor([c.shape[0] for c in ctxs], device=q.device)
    width = -(-int(lens.max()) // KV_BLOCK) * KV_BLOCK
    slots = torch.zeros(S, width, dtype=torch.int64, device=q.device)  # padding reads slot 0: masked
    for i, c in enumerate(ctxs):
        slots[i, :c.shape[0]] = c
    flat = slots.flatten()
    k = k_cache.index_select(0, flat).view(S, width, nkv, d)
    v = v_cache.index_select(0, flat).view(S, width, nkv, d)
    qf = q.view(S, nkv, g, d)
    full = (lens - 1) // KV_BLOCK  # whole blocks before each row's own
    m, den, acc = _state(S, nh, d, q.device)
    nb = int(full.max())
    kh, vh = _blocks(k[:, :nb * KV_BLOCK]), _blocks(v[:, :nb * KV_BLOCK])
    for j in range(nb):  # kh[j]: [S, nkv, KV_BLOCK, d]
        rows = (full > j).nonzero().flatten()
        if rows.numel() == S:
            o, lse = _flash_block(qf, kh[j], vh[j])
            _merge(m, den, acc, slice(0, S), o.reshape(S, nh, d), lse.reshape(S, nh))
        else:
            o, lse = _flash_block(qf[rows], kh[j].index_select(0, rows), vh[j].index_select(0, rows))
            _merge(m, den, acc, rows, o.reshape(-1, nh, d), lse.reshape(-1, nh))
    own = (full * KV_BLOCK)[:, None] + torch.arange(KV_BLOCK, device=q.device)  # [S, KV_BLOCK]
    own = own.clamp_(max=width - 1)
    batch = torch.arange(S, device=q.device)[:, None]
    qt = q.new_zeros(S, nkv, QUERY_TILE * g, d, dtype=torch.float32)
    qt[:, :, :g] = qf  # the row first in its tile, as a lone row is in _own_block
    past = (own >= lens[:, None])[..., None, None]  # padding (slot 0's stale KV): zeros, as in _own_block
    kb = k[batch, own].float().masked_fill_(past, 0.0)  # [S, KV_BLOCK, nkv, d]
    vb = v[batch, own].float().masked_fill_(past, 0.0)
    o, lse = _tile_attend(qt, kb.permute(0, 2, 3, 1), vb.transpose(1, 2),
                          (lens - 1)[:, None, None, None], (full * KV_BLOCK)[:, None, None, None])
    _merge(m, den, acc, slice(0, S), o[:, :, :g].reshape(S, nh, d), lse[:, :, :g].reshape(S, nh))
    return acc.div_(den[..., None]).view(S, nh * d)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _flash_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked flash attention of ``q [B, nkv, rows, d]`` over one whole key block ``k, v [B, nkv,
    KV_BLOCK, d]``: ``(o [B, nkv, rows, d], lse [B, nkv, rows])``, by calls of one shape only.

    The kernel's result for a row is not independent of the number of query rows in its call: on
    an AVX-512 CPU (AMD Zen 4) a call whose length leaves a tail of 1-3 rows past its 32-row
    blocks computes those rows by another path, so in float32 a prompt's KV differed with the
    chunking and a decode row's KV from the prefill's (tests/integration/test_batch_invariance.py;
    it held on the AVX2 machine the mode was built on). Here the rows are zero-padded to whole
    tiles of :data:`FLASH_QUERY_ROWS` and the tiles go as the batch dimension of one call, so
    every call has ``FLASH_QUERY_ROWS`` query rows and ``KV_BLOCK`` keys, and a row's result does
    not depend on its place in its tile, on the other rows or on the batch (checked by
    tests/unit/test_batch_invariant_attention.py)."""
    B, h, n, d = q.shape
    t = -(-n // FLASH_QUERY_ROWS)
    qp = q.new_zeros(B, h, t * FLASH_QUERY_ROWS, d)
    qp[:, :, :n] = q
    qp = qp.view(B, h, t, FLASH_QUERY_ROWS, d).transpose(1, 2).reshape(B * t, h, FLASH_QUERY_ROWS, d)
    o, lse = _FLASH(qp, _per_tile(k, t), _per_tile(v, t), 0.0, False)
    o = o.reshape(B, t, h, FLASH_QUERY_ROWS, d).transpose(1, 2).reshape(B, h, t * FLASH_QUERY_ROWS, d)[:, :, :n]
    lse = lse.reshape(B, t, h, FLASH_QUERY_ROWS).transpose(1, 2).reshape(B, h, t * FLASH_QUERY_ROWS)[:, :, :n]
    return o, lse


def _per_tile(x: torch.Tensor, t: int) -> torch.Tensor:
    """``x [B, ...]`` with each entry repeated for its ``t`` query tiles (``[B * t, ...]``, entry-major):
    a view when ``B`` or ``t`` is 1 (a prefill's one sequence, decode rows' one tile; the kernel takes
    a stride-0 batch, and copying a block per tile cost ~20 % of the call), else a copy."""
    if t == 1:
        return x
    if x.shape[0] == 1:
        return x.expand(t, *x.shape[1:])
    return x.repeat_interleave(t, dim=0)


def _state(n: int, nh: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merge state of ``n`` rows, float32: running max, denominator, unnormalized output."""
    f = torch.float32
    return (torch.full((n, nh), -math.inf, dtype=f, device=device), torch.zeros(n, nh, dtype=f, device=device),
            torch.zeros(n, nh, d, dtype=f, device=device))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x [..., nb * KV_BLOCK, nkv, d]`` as ``[nb, ..., nkv, KV_BLOCK, d]``, contiguous: ``[j]`` is
    key block ``j`` (of every leading entry) as the flash kernel takes it."""
    *lead, n, h, d = x.shape
    y = x.reshape(*lead, n // KV_BLOCK, KV_BLOCK, h, d).transpose(-3, -2)
    return y.movedim(len(lead), 0).contiguous()


def _merge(m: torch.Tensor, den: torch.Tensor, acc: torch.Tensor, rows: slice | torch.Tensor, o: torch.Tensor,
           lse: torch.Tensor) -> None:
    """Add a part ``o [r, nh, d]`` (normalized) with log-sum-exp ``lse [r, nh]`` to ``rows`` of the
    running state (max ``m``, denominator ``den``, unnormalized ``acc``), in place."""
    mr = m[rows]
    m_new = torch.maximum(mr, lse)
    a, b = (mr - m_new).exp_(), (lse - m_new).exp_()
    acc[rows] = acc[rows].mul_(a[..., None]).add_(o * b[..., None])
    den[rows] = den[rows].mul_(a).add_(b)
    m[rows] = m_new


def _own_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos0: int, nkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's attention over its own key block up to its position: ``(o [n, nh, d], lse [n, nh])``.
    Rows are grouped by block; each group runs on tiles of :data:`QUERY_TILE` rows (× the query
    heads of a KV head) against the block's :data:`KV_BLOCK` keys, zero-padded, keys past a row masked."""
    n, nh, d = q.shape
    g = nh // nkv
    o_all, lse_all = q.new_empty(n, nh, d, dtype=torch.float32), q.new_empty(n, nh, dtype=torch.float32)
    pos = torch.arange(pos0, pos0 + n, device=q.device)
    blocks = pos // KV_BLOCK
    for j in torch.unique(blocks).tolist():
        rows = (blocks == j).nonzero().flatten()
        r, r_pad = rows.numel(), -(-rows.numel() // QUERY_TILE) * QUERY_TILE
        qt = q.new_zeros(r_pad, nkv, g, d, dtype=torch.float32)
        qt[:r] = q[rows].view(r, nkv, g, d)
        qt = qt.transpose(0, 1).reshape(nkv, r_pad // QUERY_TILE, QUERY_TILE * g, d)
        kb, vb = k.new_zeros(KV_BLOCK, nkv, d, dtype=torch.float32), v.new_zeros(KV_BLOCK, nkv, d, dtype=torch.float32)
        end = min((j + 1) * KV_BLOCK, k.shape[0])
        kb[:end - j * KV_BLOCK], vb[:end - j * KV_BLOCK] = k[j * KV_BLOCK:end], v[j * KV_BLOCK:end]
        row_pos = torch.full((r_pad,), int(pos[rows[-1]]), device=q.device)
        row_pos[:r] = pos[rows]
        row_pos = row_pos.view(-1, QUERY_TILE).repeat_interleave(g, 1)[None, :, :, None]
        o, lse = _tile_attend(qt, kb.permute(1, 2, 0)[:, None], vb.transpose(0, 1)[:, None], row_pos, j * KV_BLOCK)
        o_all[rows] = o.view(nkv, r_pad, g, d)[:, :r].transpose(0, 1).reshape(r, nh, d)
        lse_all[rows] = lse.view(nkv, r_pad, g)[:, :r].transpose(0, 1).reshape(r, nh)
    return o_all, lse_all


def _tile_attend(qt: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, row_pos: torch.Tensor,
                 key_start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query tiles ``qt [..., QUERY_TILE * g, d]`` against one key block ``kb [..., d, KV_BLOCK]``,
    ``vb [..., KV_BLOCK, d]`` whose first key is at ``key_start``; keys past a row's position
    (``row_pos``, broadcast to ``[..., QUERY_TILE * g, 1]``) masked. ``(o, lse)``, ``o`` normalized."""
    s = torch.matmul(qt, kb).mul_(1.0 / math.sqrt(qt.shape[-1]))  # [..., Tq*g, KV_BLOCK]
    s.masked_fill_(torch.arange(KV_BLOCK, device=qt.device) + key_start > row_pos, -math.inf)
    mx = s.amax(-1)
    p = (s - mx[..., None]).exp_()
    den = p.sum(-1)
    return torch.matmul(p, vb).div_(den[..., None]), mx + den.log()
