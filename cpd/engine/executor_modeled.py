"""The ``modeled`` executor: the real engine with the model forward replaced by the cost model.

A step *waits* for :meth:`RooflineCostModel.step_time_s` of what it scheduled (prefill chunks
with their cached context, decodes with their context), multiplied by ``time_dilation`` (K×
slower than the modeled hardware, so that the Python overhead of a step stays small against
the modeled time; a bench divides measured times by K). Loads wait for the modeled transfer
time of the *modeled* bytes over the tier's link (L2: PCIe, L3 and handoff: NIC).

Pseudo tokens: the token after a sequence is a fixed function of the sequence's length and its
last :data:`PSEUDO_CONTEXT` tokens (crc32, mod the vocabulary, never an EOS id), so the same
request sequence gives the same tokens on every path (one engine, or prefill here and decode
after a handoff) — the modeled stand-in for the greedy correctness oracle. Sampling
parameters other than ``max_tokens`` / stop ids do not change pseudo tokens.

KV payloads: the pools hold ``payload_fraction`` of the modeled bytes (default 1/8192: a
Llama-3.1-8B token is 128 KiB modeled, 16 B held), laid out as one layer with one KV head,
so L1/L2/L3/handoff move real (small) arrays through the real code paths while their *times*
follow the modeled bytes. This module does not import torch.
"""
from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cpd.costmodel.model_shapes import MODELS_DIR
from cpd.engine.executor import ForwardSeq, KVLayout
from cpd.engine.kv_arrays import NumpyKVArrays
from cpd.policy.cost_model import RooflineCostModel

PSEUDO_CONTEXT = 8  # tokens the pseudo token depends on (plus the sequence length)
DEFAULT_PAYLOAD_FRACTION = 1.0 / 8192
PAYLOAD_DTYPE = "float16"


def resolve_model_shape(name: str) -> str:
    """Shipped model-shape name matching ``name`` case-insensitively (``llama-3.1-8b`` →
    ``Llama-3.1-8B``), or ``name`` itself (a config.json path or an unknown name)."""
    for p in MODELS_DIR.glob("*.json"):
        if p.stem.lower() == name.lower():
            return p.stem
    return name


@dataclass(frozen=True)
class ModeledModelConfig:
    """Model facts the engine reads (vocabulary and EOS from the served tokenizer's model)."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None


class WallClock:
    """Waits on the real clock (a live modeled worker)."""

    def wait(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


_PACK = [struct.Struct(f"<q{n}q").pack for n in range(PSEUDO_CONTEXT + 1)]  # by context length


def pseudo_token(token_ids: Sequence[int], end: int, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> int:
    """The modeled next token after ``token_ids[:end]`` (see module docstring)."""
    ctx = token_ids[max(0, end - PSEUDO_CONTEXT):end]
    tok = zlib.crc32(_PACK[len(ctx)](end, *map(int, ctx))) % vocab_size
    while tok in eos_token_ids:
        tok = (tok + 1) % vocab_size
    return tok


def step_shape(seqs: Sequence[ForwardSeq]) -> tuple[list[tuple[int, int]], int, int]:
    """``(prefill chunks as (new, cached), decode context tokens, number of decodes)`` of a step
    in the cost model's terms: a sequence past its prompt decodes, any other one prefills."""
    prefill, ctx, num_decode = [], 0, 0
    for s in seqs:
        if s.num_computed >= s.prompt_len:
            num_decode += s.num_new
            ctx += s.num_computed
        else:
            prefill.append((s.num_new, s.num_computed))
    return prefill, ctx, num_decode


class ModeledExecutor:
    """Cost-model step times and pseudo tokens in place of a model (see module docstring).

    Args:
        cost_model: the modeled instance (model shape, GPU, TP).
        config: vocabulary / EOS / context limit the engine checks requests against.
        time_dilation: K ≥ 1 (or any > 0): every modeled wait is K× longer.
        payload_fraction: bytes held per modeled KV byte.
        clock: ``wait(seconds)``; a :class:`WallClock` by default (the simulator passes a
            virtual one).
        model_id, tokenizer_digest: namespace parts (the weights digest names the modeled shape).
    """

    def __init__(self, cost_model: RooflineCostModel, config: ModeledModelConfig, *, time_dilation: float = 1.0,
                 payload_fraction: float = DEFAULT_PAYLOAD_FRACTION, clock: Any = None,
                 model_id: str = "modeled", tokenizer_digest: str = ""):
        if time_dilation <= 0 or not 0 < payload_fraction <= 1:
            raise ValueError("time_dilation must be > 0 and payload_fraction in (0, 1]")
        self.cost_model = cost_model
        self.config = config
        self.time_dilation = float(time_dilation)
        self.payload_fraction = float(payload_fraction)
        self.clock = clock or WallClock()
        self.arrays = NumpyKVArrays(PAYLOAD_DTYPE)
        self.kv_bytes_per_token = int(cost_model.kv_bytes_per_token)
        per_token = max(1, round(self.kv_bytes_per_token * self.payload_fraction / (2 * self.arrays.element_size)))
        self.kv_layout = KVLayout(1, 1, per_token)
        self.model_id = model_id
        m = cost_model.model
        self.weights_digest = f"modeled:{m.name}:{cost_model.gpu.name}:tp{cost_model.tp}"
        self.tokenizer_digest = tokenizer_digest
        self.kv_dtype = f"modeled-{PAYLOAD_DTYPE}"
        self.num_steps = 0
        self.busy_s = 0.0  # modeled (undilated) seconds of steps and transfers
        self.last_step_s = 0.0
        self.on_wait: Callable[[str, float], None] | None = None  # (what, modeled seconds) observer

    @property
    def payload_bytes_per_token(self) -> int:
        return 2 * self.kv_layout.head_dim * self.arrays.element_size

    def payload_bytes(self, model_bytes: int) -> int:
        return int(model_bytes) * self.payload_bytes_per_token // max(1, self.kv_bytes_per_token)

    def step_time_s(self, seqs: Sequence[ForwardSeq]) -> float:
        """Modeled (undilated) seconds of one step over ``seqs``."""
        prefill, ctx, num_decode = step_shape(seqs)
        return self.cost_model.step_time_s(prefill, ctx, num_decode)

    def _wait(self, what: str, modeled_s: float) -> None:
        self.busy_s += modeled_s
        if self.on_wait is not None:
            self.on_wait(what, modeled_s)
        self.clock.wait(modeled_s * self.time_dilation)

    def forward(self, seqs: Sequence[ForwardSeq], kv: Any, sample_rows: Sequence[int]) -> Any:
        t = self.step_time_s(seqs)
        self.num_steps += 1
        self.last_step_s = t
        self._wait("step", t)
        if not sample_rows:
            return None
        c = self.config
        return [pseudo_token(seqs[i].token_ids, seqs[i].num_computed + seqs[i].num_new, c.vocab_size,
                             c.eos_token_ids) for i in sample_rows]

    def greedy_tokens(self, logits: Any) -> list[int]:
        return list(logits)

    def sample_token(self, logits: Any, row: int, params: Any, output_index: int,
                     history: Any = None) -> int:
        return int(logits[row])  # pseudo tokens: sampling settings do not apply

    def idle(self) -> None:
        """Nothing kept between steps."""

    def transfer(self, tier: str, num_tokens: int) -> None:
        if num_tokens > 0:
            self._wait(tier, self.cost_model.transfer_time_s(tier, num_tokens * self.kv_bytes_per_token))


def _served_model_facts(model_dir: str | None, shape_vocab: int) -> tuple[int, tuple[int, ...], str, str]:
    """``(vocab_size, eos ids, model id, tokenizer digest)`` of the served tokenizer's model dir
    (the router tokenizes with it, so pseudo tokens stay inside its vocabulary), read from
    ``config.json`` and the tokenizer files without torch; the shape's vocabulary without a dir."""
    if not model_dir:
        return shape_vocab, (), "modeled", ""
    import hashlib
    import json
    from pathlib import Path

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(x) for x in eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt"):
        if (d / name).exists():
            h.update(name.encode() + b"\0" + (d / name).read_bytes())
    model_id = cfg.get("cpd_model_id") or d.resolve().name
    return int(cfg["vocab_size"]), eos_ids, model_id, h.hexdigest()[:32]


def build_modeled_executor(model_shape: str = "llama-3.1-8b", hardware: str = "b200", tp: int = 1, *,
                           time_dilation: float = 1.0, payload_fraction: float = DEFAULT_PAYLOAD_FRACTION,
                           served_model_dir: str | None = None, clock: Any = None,
                           cost_model: RooflineCostModel | None = None) -> ModeledExecutor:
    """A :class:`ModeledExecutor` for ``model_shape`` (shipped name, any case, or config.json path)
    on ``tp`` GPUs of ``hardware`` (catalog name), serving the tokenizer of ``served_model_dir``.

    Raises:
        FileNotFoundError / KeyError: unknown model shape or hardware.
    """
    cm = cost_model or RooflineCostModel.build(resolve_model_shape(model_shape), hardware, tp)
    vocab, eos_ids, model_id, tok_digest = _served_model_facts(served_model_dir, cm.model.vocab_size)
    cfg = ModeledModelConfig(vocab_size=vocab, max_position_embeddings=cm.model.max_context, eos_token_ids=eos_ids)
    return ModeledExecutor(cm, cfg, time_dilation=time_dilation, payload_fraction=payload_fraction, clock=clock,
                           model_id=model_id, tokenizer_digest=tok_digest)
