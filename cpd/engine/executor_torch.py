"""The ``torch`` executor: real model math (:class:`cpd.engine.model.LlamaModel`) on the
engine's paged KV tensor. The default executor; see :mod:`cpd.engine.executor`."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import torch

from cpd.costmodel.model_shapes import load_config
from cpd.engine.batch_invariant import KV_DTYPE_SUFFIX
from cpd.engine.executor import ForwardSeq, KVLayout, TokenHistory
from cpd.engine.kv_arrays import TorchKVArrays
from cpd.engine.model import SeqBatchInfo, build_metadata
from cpd.engine.sampling import greedy_tokens, sample
from cpd.engine.seq_kv import SeqKVArena
from cpd.engine.weights import load_model_dir_with_digest, model_id_of, tokenizer_digest


class TorchExecutor:
    """Loads a HF Llama directory and runs its forward.

    Args:
        model_dir: HF Llama directory (see :mod:`cpd.engine.weights`).
        device: torch device ("cpu", "cuda", ...).
        dtype: model and KV dtype (float32 default).
        seed: seed of the generator used by unseeded sampling.
        model_id: namespace model id (default: config ``cpd_model_id`` or the dir name).
        seq_kv_bytes: cap on the contiguous per-sequence KV rows that decode and chunked
            prefill read instead of gathering blocks every step (:mod:`cpd.engine.seq_kv`);
            None = the size of the engine's KV pool, 0 = off (always gather).
        batch_invariant: compute every row by calls of fixed shapes, so that its result does not
            depend on its chunk, batch or path (:mod:`cpd.engine.batch_invariant`; slower).
    """

    def __init__(self, model_dir: str | Path, device: Any = "cpu", dtype: Any = None, seed: int = 0,
                 model_id: str | None = None, seq_kv_bytes: int | None = None, batch_invariant: bool = False):
        self.device = torch.device(device)
        if batch_invariant and self.device.type != "cpu":
            raise ValueError("batch_invariant is implemented for the CPU only (cpd.engine.batch_invariant)")
        self.dtype = dtype if dtype is not None else torch.float32
        self.model, self.config, self.weights_digest = load_model_dir_with_digest(
            model_dir, device=self.device, dtype=self.dtype)
        c = self.config
        self.kv_layout = KVLayout(c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        self.arrays = TorchKVArrays(self.dtype, self.device)
        self.kv_bytes_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * \
            self.arrays.element_size
        self.model_id = model_id or model_id_of(model_dir)
        self._model_shape = dataclasses.replace(load_config(Path(model_dir) / "config.json"), name=self.model_id)
        self.tokenizer_digest = tokenizer_digest(model_dir)
        self.model.set_batch_invariant(batch_invariant)
        self.batch_invariant = batch_invariant
        # the KV's numeric flavour is a namespace part: batch-invariant KV is never mixed with other KV
        self.kv_dtype = str(self.dtype).replace("torch.", "") + (KV_DTYPE_SUFFIX if batch_invariant else "")
        self._gen = torch.Generator().manual_seed(seed)
        # batch-invariant attention reads the pool's blocks, never the contiguous rows: no arena to keep
        self.seq_kv = SeqKVArena(self.dtype, self.device, 0 if batch_invariant else seq_kv_bytes)

    @property
    def model_shape(self):
        """The architecture (:class:`cpd.costmodel.model_shapes.ModelShape`, read from the model's
        ``config.json`` by the one shape reader) of the loaded model: what the worker tells the
        router of its prefill cost's shape (``GET /info`` ``cost_prior``)."""
        return self._model_shape

    def payload_bytes(self, model_bytes: int) -> int:
        return int(model_bytes)

    def forward(self, seqs: Sequence[ForwardSeq], kv: Any, sample_rows: Sequence[int]) -> Any:
        infos = [SeqBatchInfo(s.num_computed, s.num_new, list(s.blocks)) for s in seqs]
        input_ids: list[int] = []
        for s in seqs:
            input_ids.extend(s.token_ids[s.num_computed:s.num_computed + s.num_new])
        arena = self.seq_kv.plan(seqs, kv) if self.seq_kv.max_bytes != 0 else None
        meta = build_metadata(infos, kv.shape[3], self.device, arena)
        ids_t = torch.as_tensor(input_ids, dtype=torch.int64, device=self.device)
        try:
            if sample_rows:
                return self.model(ids_t, meta, kv, meta.last_token_indices[list(sample_rows)])
            self.model(ids_t, meta, kv, meta.last_token_indices[:1])
        except BaseException:
            self.seq_kv.reset()  # rows may hold part of the failed step
            raise
        return None

    def greedy_tokens(self, logits: Any) -> list[int]:
        return greedy_tokens(logits)

    def sample_token(self, logits: Any, row: int, params: Any, output_index: int,
                     history: TokenHistory | None = None) -> int:
        return sample(logits[row], params, output_index, self._gen, history)

    def idle(self) -> None:
        """Forget the contiguous KV rows (nothing is running); their storage is kept for the
        next request (:mod:`cpd.engine.seq_kv`)."""
        self.seq_kv.forget()

    def transfer(self, tier: str, num_tokens: int) -> None:
        """Real copies take their own time: nothing to add."""
