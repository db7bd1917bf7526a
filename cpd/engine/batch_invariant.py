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

This mode computes every row with calls of one fixed shape, whatever the batch:

- linears run on tiles of exactly :data:`TILE_ROWS` rows (the last tile zero-padded), so every
  call has the same ``M`` and a row's result depends on that row alone;
- attention runs in float32 on query tiles of :data:`QUERY_TILE` rows against key blocks of
  :data:`KV_BLOCK` positions counted from position 0, merged in block order by an online
  softmax. A key past a query's position is masked to probability exactly 0 (its term adds an exact
  zero), and a block wholly past it is an exact no-op for that row, so a row's output depends
  only on the K/V of positions up to its own — not on the chunk, the batch or the path (prefill,
  decode, decode-local append, a handoff's imported prefix).

Its price is compute: padded tiles, the whole key block computed before masking, float32 attention
and many small calls (``docs/results/engine_speed``). It is what vLLM's batch-invariant mode and
SGLang's deterministic inference do with their own GPU kernels; here it is built from torch's, with
the shapes fixed. Its KV is a numeric flavour of its own (the ``kv_dtype`` namespace part gets
:data:`KV_DTYPE_SUFFIX`), so it is never mixed with KV computed the ordinary way.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

#: rows per linear call
TILE_ROWS = 64
#: query rows per attention tile
QUERY_TILE = 16
#: key positions per attention block (blocks start at positions 0, KV_BLOCK, 2 KV_BLOCK, ...)
KV_BLOCK = 128
#: appended to the executor's ``kv_dtype`` (a namespace part) in this mode
KV_DTYPE_SUFFIX = "+batch-invariant"

Linear = Callable[..., torch.Tensor]


def tiled_linear(big: Linear) -> Linear:
    """``big(x, w, b)`` computed on tiles of :data:`TILE_ROWS` rows of ``x``."""
    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        pad = (-m) % TILE_ROWS
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return torch.cat([big(x[i:i + TILE_ROWS], w, b) for i in range(0, x.shape[0], TILE_ROWS)])[:m]
    return linear


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
        k = k_cache.index_select(0, ctx).float()
        v = v_cache.index_select(0, ctx).float()
        out[qs:qs + n] = _attend_seq(q[qs:qs + n].float(), k, v, num_kv_heads).to(q.dtype)
    return out


def _attend_seq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nkv: int) -> torch.Tensor:
    """One sequence: ``q [n, nh, d]`` at positions ``L - n .. L - 1`` over ``k, v [L, nkv, d]``
    (float32) → ``[n, nh * d]``."""
    n, nh, d = q.shape
    L, g = k.shape[0], nh // nkv
    n_pad, L_pad = -(-n // QUERY_TILE) * QUERY_TILE, -(-L // KV_BLOCK) * KV_BLOCK
    # queries as [nkv, g * tiles, QUERY_TILE, d]: one batch entry per (query head, tile)
    qt = q.new_zeros(n_pad, nkv, g, d)
    qt[:n] = q.view(n, nkv, g, d)
    qt = qt.permute(1, 2, 0, 3).reshape(nkv, g * (n_pad // QUERY_TILE), QUERY_TILE, d)
    # keys and values as contiguous [blocks, nkv, 1, d, KV_BLOCK] / [blocks, nkv, 1, KV_BLOCK, d]
    kb = k.new_zeros(L_pad, nkv, d)
    kb[:L] = k
    kb = kb.view(-1, KV_BLOCK, nkv, d).permute(0, 2, 3, 1).contiguous()[:, :, None]
    vb = v.new_zeros(L_pad, nkv, d)
    vb[:L] = v
    vb = vb.view(-1, KV_BLOCK, nkv, d).transpose(1, 2).contiguous()[:, :, None]
    # every padded query row sits at the last position (its output is dropped)
    pos = torch.full((n_pad,), L - 1, dtype=torch.int64, device=q.device)
    pos[:n] = torch.arange(L - n, L, device=q.device)
    pos = pos.view(-1, QUERY_TILE).repeat(g, 1)[None, :, :, None]  # [1, g * tiles, QUERY_TILE, 1]
    shape = qt.shape[:3]
    m = qt.new_full(shape, -math.inf)
    den = qt.new_zeros(shape)
    acc = qt.new_zeros(qt.shape)
    scale = 1.0 / math.sqrt(d)
    key_pos = torch.arange(KV_BLOCK, device=q.device)
    for j in range(L_pad // KV_BLOCK):
        s = torch.matmul(qt, kb[j]).mul_(scale)  # [nkv, g * tiles, QUERY_TILE, KV_BLOCK]
        s.masked_fill_(key_pos + j * KV_BLOCK > pos, -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        alpha = (m - m_new).exp_()
        p = (s - m_new[..., None]).exp_()
        den = den.mul_(alpha).add_(p.sum(-1))
        acc = acc.mul_(alpha[..., None]).add_(torch.matmul(p, vb[j]))
        m = m_new
    o = acc.div_(den[..., None]).view(nkv, g, n_pad, d)[:, :, :n]
    return o.permute(2, 0, 1, 3).reshape(n, nh * d)
