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

    Attributes:
        positions: ``[T]`` int64 absolute positions of the flat tokens.
        slot_mapping: ``[T]`` int64 flat cache slot (``block * block_size + offset``) of each new token.
        seqs: per sequence ``(query_start, num_new, context_slots [num_prior+num_new] int64)``.
        last_token_indices: ``[S]`` int64 index in the flat batch of each sequence's last token.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seqs: list[tuple[int, int, torch.Tensor]]
    last_token_indices: torch.Tensor


def build_metadata(infos: Sequence[SeqBatchInfo], block_size: int,
                   device: str | torch.device = "cpu") -> BatchMetadata:
    """Positions / slot mappings for a flat batch. Raises ``ValueError`` if a block
    table is too short for its sequence."""
    positions, slots, seqs, last = [], [], [], []
    q = 0
    for info in infos:
        total = info.num_prior + info.num_new
        if len(info.block_table) * block_size < total:
            raise ValueError(f"block table of {len(info.block_table)} blocks cannot hold {total} tokens")
        bt = torch.as_tensor(list(info.block_table), dtype=torch.int64)
        pos = torch.arange(total, dtype=torch.int64)
        ctx = bt[pos // block_size] * block_size + pos % block_size
        positions.append(pos[info.num_prior:])
        slots.append(ctx[info.num_prior:])
        seqs.append((q, info.num_new, ctx.to(device)))
        q += info.num_new
        last.append(q - 1)
    return BatchMetadata(
        positions=torch.cat(positions).to(device), slot_mapping=torch.cat(slots).to(device),
        seqs=seqs, last_token_indices=torch.as_tensor(last, dtype=torch.int64, device=device))


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def _linear(i: int, o: int, bias: bool, device, dtype) -> nn.Linear:
    lin = nn.Linear(i, o, bias=bias, device=device, dtype=dtype)
    lin.requires_grad_(False)
    return lin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, device, dtype):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, device, dtype)
        b = cfg.attention_bias
        self.q_proj = _linear(h, self.nh * d, b, device, dtype)
        self.k_proj = _linear(h, self.nkv * d, b, device, dtype)
        self.v_proj = _linear(h, self.nkv * d, b, device, dtype)
        self.o_proj = _linear(self.nh * d, h, b, device, dtype)
        mb = cfg.mlp_bias
        self.gate_proj = _linear(h, cfg.intermediate_size, mb, device, dtype)
        self.up_proj = _linear(h, cfg.intermediate_size, mb, device, dtype)
        self.down_proj = _linear(cfg.intermediate_size, h, mb, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                meta: BatchMetadata) -> torch.Tensor:
        T = x.shape[0]
        r = self.input_layernorm(x)
        q = self.q_proj(r).view(T, self.nh, self.d)
        k = self.k_proj(r).view(T, self.nkv, self.d)
        v = self.v_proj(r).view(T, self.nkv, self.d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # kv_layer: [2, num_blocks, block_size, nkv, d] -> flat slots
        k_cache = kv_layer[0].view(-1, self.nkv, self.d)
        v_cache = kv_layer[1].view(-1, self.nkv, self.d)
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        outs = []
        for (qs, n, ctx) in meta.seqs:
            L = ctx.shape[0]
            qi = q[qs:qs + n].transpose(0, 1)  # [nh, n, d]
            ki = k_cache.index_select(0, ctx).transpose(0, 1).to(q.dtype)  # [nkv, L, d]
            vi = v_cache.index_select(0, ctx).transpose(0, 1).to(q.dtype)
            if n == L:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            elif n == 1:
                o = F.scaled_dot_product_attention(qi, ki, vi, enable_gqa=True)
            else:
                prior = L - n
                mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril(diagonal=prior)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
            outs.append(o.transpose(0, 1).reshape(n, self.nh * self.d))
        attn = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
        x = x + self.o_proj(attn)
        r = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(r)) * self.up_proj(r))
        return x


class LlamaModel(nn.Module):
    """Llama decoder with paged-KV forward (see module docstring).

    Args:
        cfg: model shapes (:class:`cpd.engine.weights.ModelConfig`).
        device: torch device for parameters and activations.
        dtype: parameter / activation dtype (float32 default; RoPE and RMSNorm
            statistics are always computed in float32).
    """

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, device, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False,
                                                                    device, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).to(device), persistent=False)

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
        """cos, sin of shape ``[T, 1, head_dim]`` for int64 ``positions [T]``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_cache: torch.Tensor,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run the flat batch, writing its K/V into ``kv_cache``.

        Args:
            input_ids: ``[T]`` int64 token ids (sequence after sequence, as in ``meta``).
            meta: from :func:`build_metadata`.
            kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (written in place).
            logits_indices: ``[S]`` flat indices whose logits are wanted
                (e.g. ``meta.last_token_indices``); ``None`` = all ``T`` tokens.
        Returns:
            ``[S or T, vocab_size]`` float32 logits.
        """
        x = self.embed_tokens(input_ids.to(self.device))
        cos, sin = self.rope(meta.positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], meta)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        x = self.norm(x)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, w).float()
