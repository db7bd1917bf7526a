"""Llama-family decoder over a flat token batch with a paged KV cache.

Architecture (as in HF ``transformers`` ``LlamaForCausalLM``): token embedding →
``num_hidden_layers`` × [RMSNorm → self-attention with RoPE and grouped-query
attention → residual → RMSNorm → SwiGLU MLP → residual] → RMSNorm → lm_head
(optionally tied to the embedding). RoPE supports ``rope_theta`` and the ``llama3``
frequency scaling (Llama 3.1 paper / HF ``_compute_llama3_parameters``).

KV cache layout (shared contract, ``cpd.engine.connector``): one tensor
``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``. A
sequence's token at position ``p`` lives in block ``block_table[p // block_size]``,
slot ``p % block_size``. Keys are stored *after* RoPE.

One forward processes a flat batch of ``T`` tokens coming from several sequences.
Each sequence contributes ``num_new`` consecutive tokens starting at position
``num_prior`` (its tokens ``< num_prior`` are already in the cache). New K/V are
written into the cache first, then each sequence attends causally over its cached
prefix plus its new tokens (gathered from its blocks, then
``torch.nn.functional.scaled_dot_product_attention``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cpd.engine import batch_invariant, cpu_blas
from cpd.engine.seq_kv import ArenaStep
from cpd.engine.weights import ModelConfig


@dataclass
class SeqBatchInfo:
    """One sequence's part of a flat batch.

    Attributes:
        num_prior: tokens already in the KV cache (positions ``0 .. num_prior-1``).
        num_new: tokens in this batch (positions ``num_prior .. num_prior+num_new-1``).
        block_table: the sequence's KV block ids, in order; must cover
            ``num_prior + num_new`` tokens.
    """

    num_prior: int
    num_new: int
    block_table: Sequence[int]


@dataclass
class BatchMetadata:
    """Tensors derived from a list of :class:`SeqBatchInfo` (built by :func:`build_metadata`).

    Sequences with one new token ("decode" rows, whatever their history) are attended
    to together: their KV blocks are gathered for all of them in one op per layer into
    a padded ``[B, T_max, ...]`` tensor and masked. The other sequences (prefill chunks)
    are attended to one at a time.

    Attributes:
        positions: ``[T]`` int64 absolute positions of the flat tokens.
        slot_mapping: ``[T]`` int64 flat cache slot (``block * block_size + offset``) of each new token.
        last_token_indices: ``[S]`` int64 index in the flat batch of each sequence's last token.
        prefill_seqs: per multi-token sequence ``(query_start, num_new, context_slots [num_prior+num_new])``.
        decode_q: ``[B]`` int64 flat indices of the decode rows (None when there are none).
        decode_all: the decode rows are the whole batch, in order (``decode_q == arange(T)``).
        decode_blocks: ``[B * max_blocks]`` int64 padded block tables of the decode rows
            (padding = block 0, masked).
        decode_max_blocks: blocks per padded decode row.
        decode_mask: ``[B, 1, 1, max_blocks * block_size]`` float additive mask (0 / -inf), or
            None when no row is padded.
        arena: the step's :class:`~cpd.engine.seq_kv.ArenaStep` (contiguous per-sequence KV
            rows), or None. With it, every token of a sequence that has a row is also written to
            ``arena_index`` (``(row, position)`` per token; ``arena_tokens``: their flat batch
            indices, None = all tokens), prefill chunks with a row read their context from it
            (``prefill_rows``), and the decode rows attend over ``buf[:, :, :decode_rows_used, :,
            :decode_len]`` (``decode_rows``: row of each decode row; ``decode_identity``: rows
            are ``0..B-1`` in order) with ``decode_mask`` over that many rows.
        infos / block_size / device: the inputs, for :attr:`seqs`.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_token_indices: torch.Tensor
    prefill_seqs: list[tuple[int, int, torch.Tensor]]
    decode_q: torch.Tensor | None
    decode_all: bool
    decode_blocks: torch.Tensor | None
    decode_max_blocks: int
    decode_mask: torch.Tensor | None
    infos: Sequence[SeqBatchInfo]
    block_size: int
    device: torch.device
    arena: ArenaStep | None = None
    arena_index: tuple[torch.Tensor, torch.Tensor] | None = None
    arena_tokens: torch.Tensor | None = None
    prefill_rows: list[int | None] | None = None
    decode_rows: torch.Tensor | None = None
    decode_identity: bool = False
    decode_rows_used: int = 0
    decode_len: int = 0
    decode_lens: list[int] | None = None  # context length of each decode row (in decode_q order)
    _seqs: list[tuple[int, int, torch.Tensor]] | None = None

    @property
    def seqs(self) -> list[tuple[int, int, torch.Tensor]]:
        """Per sequence ``(query_start, num_new, context_slots [num_prior+num_new] int64)``
        (all sequences; built on first use — the per-sequence reference path)."""
        if self._seqs is None:
            out, q = [], 0
            for info in self.infos:
                out.append((q, info.num_new, _context_slots(info, self.block_size, self.device)))
                q += info.num_new
            self._seqs = out
        return self._seqs


def _context_slots(info: SeqBatchInfo, block_size: int, device) -> torch.Tensor:
    total = info.num_prior + info.num_new
    bt = torch.as_tensor(list(info.block_table[:-(-total // block_size)]), dtype=torch.int64)
    ctx = (bt[:, None] * block_size + torch.arange(block_size, dtype=torch.int64)[None, :]).reshape(-1)[:total]
    return ctx.to(device)


def build_metadata(infos: Sequence[SeqBatchInfo], block_size: int,
                   device: str | torch.device = "cpu", arena: ArenaStep | None = None) -> BatchMetadata:
    """Positions / slot mappings / decode gather tables (or arena rows, with ``arena``: one
    row or None per sequence, see :class:`BatchMetadata`) for a flat batch. Raises
    ``ValueError`` if a block table is too short for its sequence."""
    device = torch.device(device)
    positions: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    prefill: list[tuple[int, int, torch.Tensor]] = []
    pre_rows: list[int | None] = []
    dec_q: list[int] = []
    dec_tables: list[Sequence[int]] = []
    dec_lens: list[int] = []
    dec_rows: list[int] = []
    ar_rows: list[int] = []
    ar_pos: list[int] = []
    ar_toks: list[int] = []
    q = 0
    for i, info in enumerate(infos):
        p0, n = info.num_prior, info.num_new
        total = p0 + n
        bt = info.block_table
        row = arena.rows[i] if arena is not None else None
        if len(bt) * block_size < total:
            raise ValueError(f"block table of {len(bt)} blocks cannot hold {total} tokens")
        if row is not None:
            ar_rows.extend([row] * n)
            ar_pos.extend(range(p0, total))
            ar_toks.extend(range(q, q + n))
        if n == 1:
            positions.append(p0)
            slots.append(bt[p0 // block_size] * block_size + p0 % block_size)
            dec_q.append(q)
            dec_tables.append(bt)
            dec_lens.append(total)
            if row is not None:
                dec_rows.append(row)
        else:
            ctx = _context_slots(info, block_size, "cpu")
            positions.extend(range(p0, total))
            slots.extend(ctx[p0:].tolist())
            prefill.append((q, n, ctx.to(device)))
            pre_rows.append(row)
        q += n
        last.append(q - 1)
    if dec_rows and len(dec_rows) != len(dec_q):
        raise ValueError("arena rows must cover every decode row or none")
    meta = BatchMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        last_token_indices=torch.tensor(last, dtype=torch.int64, device=device),
        prefill_seqs=prefill, decode_q=None, decode_all=len(dec_q) == q, decode_blocks=None,
        decode_max_blocks=0, decode_mask=None, infos=list(infos), block_size=block_size, device=device)
    if arena is not None and ar_rows:
        meta.arena = arena
        meta.arena_index = (torch.tensor(ar_rows, dtype=torch.int64, device=device),
                            torch.tensor(ar_pos, dtype=torch.int64, device=device))
        if len(ar_toks) != q:
            meta.arena_tokens = torch.tensor(ar_toks, dtype=torch.int64, device=device)
        meta.prefill_rows = pre_rows
    if dec_q:
        meta.decode_q = torch.tensor(dec_q, dtype=torch.int64, device=device)
        if dec_rows:
            _decode_arena_meta(meta, dec_rows, dec_lens)
        else:
            _decode_gather_meta(meta, dec_tables, dec_lens)
    return meta


def _length_mask(lens: list[int], width: int, device) -> torch.Tensor | None:
    """``[len(lens), 1, 1, width]`` additive float mask (0 below each length, -inf from it),
    or None when every length is ``width``."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    pad = torch.arange(width, dtype=torch.int64)[None, :] >= lens_t[:, None]
    if not bool(pad.any()):
        return None
    return torch.zeros(pad.shape, dtype=torch.float32).masked_fill_(pad, float("-inf"))[:, None, None, :].to(device)


def _decode_gather_meta(meta: BatchMetadata, tables: list[Sequence[int]], lens: list[int]) -> None:
    """Decode rows read from the pool: padded block tables for one gather per layer."""
    bs = meta.block_size
    max_blocks = -(-max(lens) // bs)
    padded = [list(bt[:max_blocks]) + [0] * (max_blocks - min(len(bt), max_blocks)) for bt in tables]
    meta.decode_blocks = torch.tensor(padded, dtype=torch.int64).reshape(-1).to(meta.device)
    meta.decode_max_blocks = max_blocks
    meta.decode_lens = list(lens)
    meta.decode_mask = _length_mask(lens, max_blocks * bs, meta.device)


def _decode_arena_meta(meta: BatchMetadata, rows: list[int], lens: list[int]) -> None:
    """Decode rows read from arena rows ``0 .. max(rows)``; rows no decode row uses attend
    to their slot 0 only (finite values, output dropped)."""
    used = max(rows) + 1
    width = max(lens)
    per_row = [1] * used
    for r, n in zip(rows, lens):
        per_row[r] = n
    meta.decode_rows = torch.tensor(rows, dtype=torch.int64, device=meta.device)
    meta.decode_identity = rows == list(range(len(rows)))
    meta.decode_rows_used = used
    meta.decode_len = width
    meta.decode_lens = list(lens)
    meta.decode_mask = _length_mask(per_row, width, meta.device)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, llama3-scaled if configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        factor = float(rs["factor"])
        lo = float(rs.get("low_freq_factor", 1.0))
        hi = float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs.get("original_max_position_embeddings", 8192))
        lo_wavelen, hi_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``rotate_half(x) * sin == x.roll(d/2, -1) * signed_sin``
    exactly (``(-a) * s == a * (-s)`` in IEEE arithmetic), so RoPE needs one roll instead of a
    negation, two slices and a cat per layer."""
    h = sin.shape[-1] // 2
    return torch.cat((-sin[..., :h], sin[..., h:]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        if dt == torch.float32:  # one fused op instead of six (same formula, float32 throughout)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


#: up to this many rows (a decode step's batch) a linear runs as ``w @ x.T``: MKL's sgemm for
#: ``x @ w.T`` with few rows was 12 – 20 % slower at 8 rows on an AVX2 EPYC (float32, 1 thread;
#: 8 × 576 by 576 × 49152: 25 vs 20 ms), equal at 1 row
SMALL_ROWS = 16


def _mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, big=F.linear,
        all_rows: bool = False) -> torch.Tensor:
    """``F.linear(x, w, b)`` for 2-D ``x``; as ``(w @ x.T).T`` (made contiguous) when ``x`` has at
    most :data:`SMALL_ROWS` rows (same math, another sgemm path; see :data:`SMALL_ROWS`), else by
    ``big`` (``F.linear``, or :func:`cpd.engine.cpu_blas.linear` where that is faster). With
    ``all_rows`` every row count goes to ``big`` (the layers' weights stored transposed for OpenBLAS,
    see :func:`_linear`)."""
    if all_rows or x.shape[0] > SMALL_ROWS:
        return big(x, w, b)
    y = torch.mm(w, x.t()).t().contiguous()
    return y if b is None else y + b


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """``[n, heads, d]`` token-major rows as a contiguous ``[1, heads, n, d]`` SDPA operand. The CPU
    flash kernel ran 10 – 15 % faster on contiguous head-major q/k/v than on the token-major
    views of the fused qkv output (512 and 2048 causal tokens, float32, 1 thread, AVX2); the copy
    is small beside it. One token: the view (nothing to stream)."""
    x = x.transpose(0, 1)
    return (x if x.shape[1] == 1 else x.contiguous())[None]


def _linear(i: int, o: int, bias: bool, device, dtype, transposed: bool = False) -> nn.Linear:
    """``nn.Linear(i, o)`` without grad. ``transposed``: its ``[o, i]`` weight is a view of ``[i, o]``
    storage (for :func:`cpd.engine.cpu_blas.linear`: OpenBLAS then runs ``x @ W`` on the stored
    matrix as it is, which on an AVX2 EPYC (float32, 1 thread, SmolLM2's 30 layers of linears) took
    1.07x less CPU time at 128 rows and 1.4x less at 1 and 8 rows than the ``[o, i]`` storage did with
    OpenBLAS at 128 rows and MKL's ``w @ x.T`` at 1 – 8 rows; ``docs/results/engine_speed``,
    session 9)."""
    lin = nn.Linear(i, o, bias=bias, device="meta" if transposed else device, dtype=dtype)
    if transposed:
        lin.weight = nn.Parameter(torch.zeros(i, o, device=device, dtype=dtype).t(), requires_grad=False)
        if bias:
            lin.bias = nn.Parameter(torch.zeros(o, device=device, dtype=dtype), requires_grad=False)
    lin.requires_grad_(False)
    return lin


def _fused_linears(outs: Sequence[int], i: int, bias: bool, device, dtype,
                   transposed: bool = False) -> tuple[list[nn.Linear], torch.Tensor, torch.Tensor | None]:
    """Linears whose weights (and biases) are row slices of one fused tensor, so that one
    matmul computes them all; loading into each linear's parameter fills the fused tensor.
    ``transposed``: the fused ``[sum(outs), i]`` weight is a view of ``[i, sum(outs)]`` storage
    (see :func:`_linear`)."""
    if transposed:
        w = torch.zeros(i, sum(outs), device=device, dtype=dtype).t()
    else:
        w = torch.zeros(sum(outs), i, device=device, dtype=dtype)
    bvec = torch.zeros(sum(outs), device=device, dtype=dtype) if bias else None
    lins, o0 = [], 0
    for o in outs:
        lin = _linear(i, o, bias, "meta", dtype)
        lin.weight = nn.Parameter(w[o0:o0 + o], requires_grad=False)
        if bvec is not None:  # iff bias
            lin.bias = nn.Parameter(bvec[o0:o0 + o], requires_grad=False)
        lins.append(lin)
        o0 += o
    return lins, w, bvec


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        #: OpenBLAS where cpu_blas wants it: then the weights are stored transposed and every linear,
        #: whatever its row count, runs through it (else torch's, ``(w @ x.T).T`` up to SMALL_ROWS rows)
        self.weights_transposed = cpu_blas.wanted(torch.device(device), dtype)
        tr = self.weights_transposed
        b = cfg.attention_bias
        (self.q_proj, self.k_proj, self.v_proj), self._qkv_w, self._qkv_b = _fused_linears(
            (self.nh * d, self.nkv * d, self.nkv * d), h, b, device, dtype, tr)
        self.o_proj = _linear(self.nh * d, h, b, device, dtype, tr)
        mb = cfg.mlp_bias
        self.inter = cfg.intermediate_size
        (self.gate_proj, self.up_proj), self._gu_w, self._gu_b = _fused_linears(
            (cfg.intermediate_size, cfg.intermediate_size), h, mb, device, dtype, tr)
        self.down_proj = _linear(cfg.intermediate_size, h, mb, device, dtype, tr)
        #: linear of more than SMALL_ROWS rows (prefill; every linear when weights_transposed)
        self.big_linear = cpu_blas.linear if tr else F.linear
        #: every linear on fixed row tiles, attention by :func:`cpd.engine.batch_invariant.attend`
        self.batch_invariant = False

    def set_batch_invariant(self, on: bool) -> None:
        """Turn the batch-invariant math (:mod:`cpd.engine.batch_invariant`) on or off."""
        self.batch_invariant = on
        base = cpu_blas.linear if self.weights_transposed else F.linear
        self.big_linear = batch_invariant.tiled_linear(base) if on else base

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                meta: BatchMetadata, batched_decode: bool = True,
                arena_layer: torch.Tensor | None = None, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """One layer over the flat batch. ``arena_layer``: ``meta.arena.buf[layer]``
        (``[2, rows, capacity, H, D]``) when the step has arena rows. ``keep_rows``: only these
        flat rows of the output are wanted (the last layer before the logits): every token's
        K/V is still written, but the output projection and the MLP run on those rows only
        and the result is ``[len(keep_rows), hidden]``."""
        T = x.shape[0]
        nh, nkv, d = self.nh, self.nkv, self.d
        big, tr = self.big_linear, self.weights_transposed or self.batch_invariant
        r = self.input_layernorm(x)
        qkv = _mm(r, self._qkv_w, self._qkv_b, big, tr)  # [T, (nh + 2 nkv) d]
        qk = qkv[:, :(nh + nkv) * d].view(T, nh + nkv, d)
        rot = qk.roll(d // 2, -1).mul_(sin)  # sin: _signed_sin (rotate_half without the cat)
        qk.mul_(cos).add_(rot)  # RoPE on q and k together, in place in qkv
        q = qk[:, :nh]
        # the step's K and V (K after RoPE) are adjacent in qkv: [T, 2, nkv, d], written with one op each
        kv_new = qkv[:, nh * d:].view(T, 2, nkv, d).to(kv_layer.dtype)
        # kv_layer: [2, num_blocks, block_size, nkv, d] -> flat slots
        kv_layer.view(2, -1, nkv, d).index_copy_(1, meta.slot_mapping, kv_new.transpose(0, 1))
        k_cache = kv_layer[0].view(-1, nkv, d)
        v_cache = kv_layer[1].view(-1, nkv, d)
        if arena_layer is not None and meta.arena_index is not None:  # mirror into the arena rows
            at = meta.arena_tokens
            # [2, rows, H, cap, D] seen as [2, rows, cap, H, D]: (row, position) -> one token's K/V heads
            rows, pos = meta.arena_index
            arena_layer.transpose(2, 3)[:, rows, pos] = (kv_new if at is None else kv_new[at]).transpose(0, 1)
        if self.batch_invariant:
            attn = batch_invariant.attend(q, k_cache, v_cache, meta.seqs, nkv)
        elif not batched_decode:
            attn = self._attend_per_seq(q, k_cache, v_cache, meta.seqs)
        elif meta.decode_all:
            attn = self._attend_decode(q, kv_layer, meta, arena_layer)
        else:
            own = (kv_new[:, 0].to(q.dtype), kv_new[:, 1].to(q.dtype))
            attn = self._attend_per_seq(q, k_cache, v_cache, meta.prefill_seqs, T, own, arena_layer,
                                        meta.prefill_rows)
            if meta.decode_q is not None:
                attn.index_copy_(0, meta.decode_q, self._attend_decode(q.index_select(0, meta.decode_q),
                                                                       kv_layer, meta, arena_layer))
        if keep_rows is not None:
            x, attn = x.index_select(0, keep_rows), attn.index_select(0, keep_rows)
        x = x + _mm(attn, self.o_proj.weight, self.o_proj.bias, big, tr)
        r = self.post_attention_layernorm(x)
        gu = _mm(r, self._gu_w, self._gu_b, big, tr)
        act = F.silu(gu[:, :self.inter], inplace=True).mul_(gu[:, self.inter:])  # SwiGLU in place (strided rows)
        x = x + _mm(act, self.down_proj.weight, self.down_proj.bias, big, tr)
        return x

    def _attend_decode(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: BatchMetadata,
                       arena_layer: torch.Tensor | None) -> torch.Tensor:
        """Rows with one new token each, all at once, in one fused SDPA call over 4-D
        ``[B, heads, len, d]`` views with grouped KV heads (per-head ``bmm`` on strided bf16
        operands took a slow CPU path: ~15x slower at 8 x 2048). The K/V come from the arena
        rows (a view: no copy) when the step has them, else from one block gather of every
        row's blocks (padded to the longest context). Padding slots hold stale but finite
        values and are masked (probability exactly 0); no mask when nothing is padded. The query
        heads that share a KV head are passed as that head's ``nh / nkv`` query rows (one token,
        so no causal mask among them): the kernel then reads each KV head once instead of once per
        query head (``enable_gqa``), 7 – 10 % less attention time at 8 × 2048 float32 on AVX2."""
        B = q.shape[0]
        nkv, d = self.nkv, self.d
        if q.dtype != torch.float32 and meta.decode_lens is not None:
            return self._attend_decode_exact(q, kv_layer, meta, arena_layer)
        if meta.decode_rows is not None and arena_layer is not None:
            R, Tm = meta.decode_rows_used, meta.decode_len
            kv = arena_layer[:, :R, :, :Tm]  # [2, R, nkv, Tm, d] view (head-major rows)
            qr = q.view(B, self.nh, d)
            if not meta.decode_identity:
                qr = qr.new_zeros(R, self.nh, d).index_copy_(0, meta.decode_rows, qr)
            o = F.scaled_dot_product_attention(qr.view(R, nkv, self.nh // nkv, d), kv[0].to(q.dtype),
                                               kv[1].to(q.dtype), attn_mask=meta.decode_mask).view(R, self.nh * d)
            return o if meta.decode_identity else o.index_select(0, meta.decode_rows)
        if meta.decode_blocks is None:
            raise ValueError("batched decode attention needs meta.decode_blocks or arena rows")
        nb, bs = kv_layer.shape[1], kv_layer.shape[2]
        kv = kv_layer.view(2, nb, bs * nkv * d).index_select(1, meta.decode_blocks)
        Tm = meta.decode_max_blocks * bs
        kv = kv.view(2, B, Tm, nkv, d).to(q.dtype)
        o = F.scaled_dot_product_attention(q.view(B, nkv, self.nh // nkv, d), kv[0].transpose(1, 2),
                                           kv[1].transpose(1, 2), attn_mask=meta.decode_mask)
        return o.view(B, self.nh * d)

    def _attend_decode_exact(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: BatchMetadata,
                             arena_layer: torch.Tensor | None) -> torch.Tensor:
        """Decode attention in reduced precision: one unmasked SDPA call per row over exactly its
        own context, so a row's result does not depend on the batch it runs in. In bf16 the
        padded, masked batch call of :meth:`_attend_decode` takes other kernels than a lone row's
        unmasked call, and their rounding differed enough to flip greedy tokens (batched decode vs
        the same prompt alone, on an AVX2 CPU); the oracle (same greedy tokens on every path)
        outranks the one fused call. float32 keeps the fused call (its paths agree)."""
        assert meta.decode_lens is not None
        nh, nkv, d, bs = self.nh, self.nkv, self.d, kv_layer.shape[2]
        outs = []
        for i, n in enumerate(meta.decode_lens):
            if meta.decode_rows is not None and arena_layer is not None:
                kv = arena_layer[:, int(meta.decode_rows[i]), :, :n].transpose(1, 2)  # [2, n, nkv, d]
            else:
                if meta.decode_blocks is None:
                    raise ValueError("batched decode attention needs meta.decode_blocks or arena rows")
                blocks = meta.decode_blocks.view(-1, meta.decode_max_blocks)[i, :-(-n // bs)]
                kv = kv_layer.index_select(1, blocks).reshape(2, -1, nkv, d)[:, :n]
            kv = kv.to(q.dtype)
            outs.append(F.scaled_dot_product_attention(q[i].view(1, nh, 1, d), kv[0].transpose(0, 1)[None],
                                                       kv[1].transpose(0, 1)[None], enable_gqa=True).view(1, nh * d))
        return torch.cat(outs)

    def _attend_per_seq(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        seqs: list[tuple[int, int, torch.Tensor]], T: int | None = None,
                        own: tuple[torch.Tensor, torch.Tensor] | None = None,
                        arena_layer: torch.Tensor | None = None,
                        rows: list[int | None] | None = None) -> torch.Tensor:
        """Prefill attention on torch's fused SDPA kernels (flash on CPU and CUDA: the inputs
        are 4-D ``[batch, heads, len, d]`` with grouped KV heads, which is what selects them;
        3-D inputs fall back to the slow math path). Sequences of equal shape with no cached
        prefix run as one batch; the others one at a time (a chunk on top of a cached prefix
        takes a bottom-right causal mask; float32 on CPU, with ``own``: the split of
        :meth:`_attend_chunk_split`). Where the context comes from: with ``own`` (the step's
        K/V ``[T, nkv, d]``) a sequence without cached prefix reads its own new K/V;
        a sequence with an arena row (``rows[i]``) reads a view of that row; otherwise the
        context is gathered from the pool (the per-sequence reference path always gathers).
        With ``T``, into a ``[T, nh*d]`` buffer whose rows not covered by ``seqs`` are left
        for the caller."""
        outs: list[tuple[int, int, torch.Tensor]] = []
        by_len: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        rest = []
        for i, sq in enumerate(seqs):  # fresh sequences (no cached prefix) grouped by length
            row = rows[i] if rows is not None else None
            if sq[1] > 1 and sq[1] == sq[2].shape[0]:
                by_len.setdefault(sq[1], []).append(sq)
            else:
                rest.append((sq, row))
        for group in by_len.values():
            if len(group) > 1:
                outs.extend(self._attend_batch(q, k_cache, v_cache, group, own))
            else:
                rest.extend((sq, None) for sq in group)
        for (qs, n, ctx), row in rest:
            L = ctx.shape[0]
            qi = _head_major(q[qs:qs + n])  # [1, nh, n, d]
            if own is not None and n == L:
                ki, vi = _head_major(own[0][qs:qs + n]), _head_major(own[1][qs:qs + n])
            elif row is not None and arena_layer is not None:  # views of head-major rows
                ki, vi = arena_layer[0, row, :, :L][None].to(q.dtype), arena_layer[1, row, :, :L][None].to(q.dtype)
            else:
                ki = _head_major(k_cache.index_select(0, ctx).to(q.dtype))
                vi = _head_major(v_cache.index_select(0, ctx).to(q.dtype))
            if n == L:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            elif n == 1:
                o = F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)
            elif own is not None and q.device.type == "cpu" and q.dtype == torch.float32:
                o = self._attend_chunk_split(qi, ki, vi, L - n)
            else:
                prior = L - n
                mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=prior)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            outs.append((qs, n, o[0].transpose(0, 1).reshape(n, self.nh * self.d)))
        if len(outs) == 1 and (T is None or (outs[0][0] == 0 and outs[0][1] == T)):
            return outs[0][2]  # one sequence covers the batch: its output is the result (no copy)
        if T is None:
            return torch.cat([o for _, _, o in sorted(outs, key=lambda x: x[0])], 0)
        attn = q.new_empty(T, self.nh * self.d)
        for qs, n, o in outs:
            attn[qs:qs + n] = o
        return attn

    def _attend_chunk_split(self, qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, prior: int) -> torch.Tensor:
        """A float32 chunk of ``n`` queries on ``prior`` cached tokens (``qi [1, nh, n, d]``,
        ``ki``/``vi`` ``[1, nkv, prior + n, d]``) without the masked-out scores: one CPU flash call
        over the prefix (no mask; the query group folded into the query length, so no KV copy)
        and one causal call over the chunk itself, merged by their log-sum-exps. With an explicit
        bottom-right mask the kernel computes all ``n × (prior + n)`` scores; this computes
        ``n × prior + n² / 2``, as the unchunked prefill does for the same rows. float32 only:
        in bf16 the merge differed from the masked call by ~6e-3 and flipped the warm-L3 path's
        greedy tokens against the oracle (reverted in bfad80b); in float32 it is ~1e-7."""
        nh, nkv, d, n = self.nh, self.nkv, self.d, qi.shape[2]
        g = nh // nkv
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(qi.reshape(1, nkv, g * n, d), ki[:, :, :prior], vi[:, :, :prior], 0.0, False)
        kc, vc = ki[:, :, prior:], vi[:, :, prior:]
        if g > 1:
            kc, vc = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)
        o2, l2 = flash(qi, kc, vc, 0.0, True)  # [1, nh, n, d], [1, nh, n]
        l1 = l1.reshape(1, nh, n)
        m = torch.maximum(l1, l2)
        w1, w2 = l1.sub_(m).exp_()[..., None], l2.sub_(m).exp_()[..., None]
        return o1.reshape(1, nh, n, d).mul_(w1).addcmul_(o2, w2).div_(w1.add_(w2))

    def _attend_batch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      seqs: list[tuple[int, int, torch.Tensor]],
                      own: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[tuple[int, int, torch.Tensor]]:
        """Equal-length sequences without a cached prefix, as one causal SDPA batch (K/V from
        ``own``, the step's new K/V, when given; else gathered from the pool)."""
        S, n = len(seqs), seqs[0][1]
        qi = torch.stack([q[qs:qs + n].transpose(0, 1) for qs, _, _ in seqs])  # [S, nh, n, d] contiguous
        if own is not None:
            ki = torch.stack([own[0][qs:qs + n].transpose(0, 1) for qs, _, _ in seqs])
            vi = torch.stack([own[1][qs:qs + n].transpose(0, 1) for qs, _, _ in seqs])
        else:
            ctx = torch.cat([c for _, _, c in seqs])
            ks, vs = k_cache.index_select(0, ctx).to(q.dtype), v_cache.index_select(0, ctx).to(q.dtype)
            ki = ks.view(S, n, self.nkv, self.d).transpose(1, 2).contiguous()
            vi = vs.view(S, n, self.nkv, self.d).transpose(1, 2).contiguous()
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)  # [S, nh, n, d]
        o = o.transpose(1, 2).reshape(S, n, self.nh * self.d)
        return [(qs, n, o[i]) for i, (qs, _, _) in enumerate(seqs)]


class LlamaModel(nn.Module):
    """Llama decoder with paged-KV forward (see module docstring).

    Args:
        cfg: model shapes (:class:`cpd.engine.weights.ModelConfig`).
        device: torch device for parameters and activations.
        dtype: parameter / activation dtype (float32 default; RoPE and RMSNorm
            statistics are always computed in float32).
    """

    inv_freq: torch.Tensor  # registered buffer (non-persistent)

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, dtype) for _ in range(cfg.num_hidden_layers))
        #: the logits' linear: torch's, or OpenBLAS where cpu_blas wants it (as the layers choose)
        self.big_linear = cpu_blas.linear if cpu_blas.wanted(self.device, dtype) else F.linear
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False,
                                                                    device, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)
        #: attend one-token rows of a batch together (False: the per-sequence reference path)
        self.batched_decode = True
        self.batch_invariant = False

    def set_batch_invariant(self, on: bool) -> None:
        """Every row computed by calls of fixed shapes (:mod:`cpd.engine.batch_invariant`): a
        row's result then depends on its own inputs only, not on its chunk, batch or path."""
        self.batch_invariant = on
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.set_batch_invariant(on)
        base = cpu_blas.linear if cpu_blas.wanted(self.device, self.dtype) else F.linear
        self.big_linear = batch_invariant.tiled_linear(base) if on else base

    # HF name -> our module path
    _HF_RENAMES = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
                   "self_attn.o_proj": "o_proj", "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
                   "mlp.down_proj": "down_proj"}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors (``model.layers.{i}.self_attn.q_proj.weight`` ...) in.

        Raises:
            KeyError: a parameter is missing (``lm_head.weight`` may be absent when tied).
            ValueError: a shape mismatch.
        """
        ours = dict(self.named_parameters())
        mapped: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            n = name[len("model."):] if name.startswith("model.") else name
            if n.startswith("layers."):
                for a, b in self._HF_RENAMES.items():
                    n = n.replace("." + a + ".", "." + b + ".")
            if n == "lm_head.weight" and self.lm_head is None:
                continue
            if n in ours:
                mapped[n] = t
        missing = [k for k in ours if k not in mapped]
        if missing:
            raise KeyError(f"missing parameters: {missing[:8]}")
        with torch.no_grad():
            for k, t in mapped.items():
                p = ours[k]
                if p.shape != t.shape:
                    raise ValueError(f"shape mismatch for {k}: {tuple(t.shape)} vs {tuple(p.shape)}")
                p.copy_(t.to(device=p.device, dtype=p.dtype))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and :func:`_signed_sin` of shape ``[T, 1, head_dim]`` for int64 ``positions [T]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], _signed_sin(emb.sin().to(self.dtype)[:, None, :])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_cache: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run the flat batch, writing its K/V into ``kv_cache``.

        Args:
            input_ids: ``[T]`` int64 token ids (sequence after sequence, as in ``meta``).
            meta: from :func:`build_metadata`.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (written in place).
            logits_indices: ``[S]`` flat indices whose logits are wanted
                (e.g. ``meta.last_token_indices``); ``None`` = all ``T`` tokens. The last layer
                runs its output projection and MLP on these rows only (all K/V are written).
        Returns:
            ``[S or T, vocab_size]`` float32 logits.
        """
        x = self.embed_tokens(input_ids.to(self.device))
        cos, sin = self.rope(meta.positions)
        if meta.decode_mask is not None and meta.decode_mask.dtype != self.dtype:
            meta.decode_mask = meta.decode_mask.to(self.dtype)
        bd = self.batched_decode
        buf = meta.arena.buf if meta.arena is not None else None
        last = len(self.layers) - 1  # it computes only the rows whose logits are wanted
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], meta, bd, None if buf is None else buf[i],
                      logits_indices if i == last else None)
        if logits_indices is not None and last < 0:
            x = x.index_select(0, logits_indices)
        x = self.norm(x)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return _mm(x, w, None, self.big_linear, self.batch_invariant).float()
