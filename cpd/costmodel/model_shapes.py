"""Model shapes read from Hugging Face ``config.json`` files.

Shipped configs (``cpd/costmodel/data/models/``): Llama-3.1-8B, Llama-3.1-70B, Qwen3-32B,
with the architecture fields of the public model cards' ``config.json``
(meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B, Qwen/Qwen3-32B on Hugging Face).
Dense decoder-only transformers with grouped-query attention and a gated MLP.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path(__file__).parent / "data" / "models"


@dataclass(frozen=True)
class ModelShape:
    """Shapes that drive compute and KV size.

    Attributes:
        name: model name.
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size:
            as in ``config.json``.
        max_context: ``max_position_embeddings`` (tokens).
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    tie_word_embeddings: bool = False

    @property
    def params_per_layer(self) -> int:
        """Matmul parameters of one layer: Q, K, V, O projections and the 3 gated-MLP matrices."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + 3 * h * self.intermediate_size

    @property
    def linear_params(self) -> int:
        """Parameters that take part in a matmul per token (layers + LM head)."""
        return self.num_layers * self.params_per_layer + self.vocab_size * self.hidden_size

    @property
    def prefill_attn_coeff(self) -> float:
        """The shape of prefill cost: attention FLOPs of one new token per context token
        (``4 · layers · heads · head_dim``: QK^T and AV) over its linear FLOPs
        (``2 · linear_params``). A prefill of ``n`` tokens on ``p`` cached costs
        ``n · (1 + prefill_attn_coeff · (p + n/2))`` token-equivalents of linear work
        (:func:`cpd.policy.routing.prefill_work_tokens`)."""
        return 2.0 * self.num_layers * self.num_heads * self.head_dim / self.linear_params

    @property
    def total_params(self) -> int:
        """All weights (embedding counted once more unless tied)."""
        emb = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.linear_params + emb

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> int:
        """K and V of all layers for one token, bytes: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes)


def load_config(path_or_name: str | Path) -> ModelShape:
    """Read a Hugging Face ``config.json`` (a path, or a shipped model name like ``Llama-3.1-8B``).

    Raises:
        FileNotFoundError: neither a file nor a shipped name.
        KeyError: a required field is missing.
    """
    p = Path(path_or_name)
    if not p.is_file():
        p = MODELS_DIR / f"{path_or_name}.json"
        if not p.is_file():
            known = sorted(x.stem for x in MODELS_DIR.glob("*.json"))
            raise FileNotFoundError(f"no config {path_or_name!r}; shipped: {known}")
    c = json.loads(p.read_text())
    heads = c["num_attention_heads"]
    return ModelShape(
        name=p.stem, hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, vocab_size=c["vocab_size"],
        max_context=c.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))
