"""Roofline cost model: implements the :class:`cpd.policy.routing.CostModel` protocol.

Pure arithmetic (no I/O, no clock). Used by the simulator for step times and by the
routing policy for load-versus-recompute decisions; a live router may use it as a prior.

Formulas (one instance = ``tp`` GPUs running one model replica with tensor parallelism):

* Prefill of ``n`` new tokens on ``p`` cached tokens::

      flops   = 2 * linear_params * n  +  4 * layers * heads * head_dim * n * (p + n/2)
      compute = flops / (peak * compute_eff * tp)
      memory  = (weight_bytes + kv_bytes_per_token * (p + n)) / (hbm_bw * hbm_eff * tp)
      t       = max(compute, memory) + allreduce(n) + step_overhead_s

  The attention term counts QK^T and AV (2 matmuls x 2 FLOP per MAC) over the mean
  causal context ``p + n/2``.
* All-reduce (``tp > 1``): 2 per layer, each of ``n * hidden * act_bytes`` bytes, ring:
  ``2 (tp-1)/tp * bytes / (nvlink_bw * link_eff) + allreduce_latency_s``.
* Decode step of a batch with context lengths ``c_i``: as prefill with one new token per
  sequence: ``max(flops_time, (weights + kv_bytes_per_token * sum c_i) / hbm_bw)`` plus
  all-reduce and ``decode_overhead_s``.
* Transfer (load from L2 over PCIe, from L3 / handoff over the NIC):
  ``bytes / (link_bw * tp * link_eff) + latency``.

Efficiencies (fractions of peak) are configuration; defaults are documented in
``docs/simulator.md`` and were picked from commonly reported ranges (prefill MFU 40-60 %,
HBM 70-85 %, RDMA 80-90 %), not measured here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from cpd.costmodel.hardware import GPU, get_gpu
from cpd.costmodel.model_shapes import ModelShape, load_config


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that the engine reaches, and fixed overheads (seconds)."""

    compute: float = 0.5
    hbm: float = 0.8
    nvlink: float = 0.7
    pcie: float = 0.8
    nic: float = 0.85
    step_overhead_s: float = 2e-3
    decode_overhead_s: float = 1e-3
    allreduce_latency_s: float = 10e-6
    l2_latency_s: float = 1e-4
    l3_latency_s: float = 2e-3


@dataclass(frozen=True)
class RooflineCostModel:
    """Roofline costs for one instance of ``model`` on ``tp`` GPUs of type ``gpu``.

    Attributes:
        model: shapes (see :func:`cpd.costmodel.model_shapes.load_config`).
        gpu: hardware entry (see :mod:`cpd.costmodel.hardware`).
        tp: tensor-parallel degree (GPUs per instance).
        weight_bytes_per_param: 2 for BF16 weights, 1 for FP8.
        kv_dtype_bytes: bytes per KV element (2 = BF16, 1 = FP8).
        fp8_compute: use the FP8 peak instead of BF16.
        eff: efficiencies and overheads.
    """

    model: ModelShape
    gpu: GPU
    tp: int = 1
    weight_bytes_per_param: float = 2.0
    kv_dtype_bytes: float = 2.0
    fp8_compute: bool = False
    eff: Efficiency = field(default_factory=Efficiency)

    @classmethod
    def build(cls, model: str, gpu: str, tp: int = 1, **kw: Any) -> "RooflineCostModel":
        """From a shipped model name or config.json path and a catalog GPU name."""
        e = kw.pop("eff", None)
        if isinstance(e, dict):
            e = Efficiency(**e)
        return cls(load_config(model), get_gpu(gpu), tp, eff=e or Efficiency(), **kw)

    # -- derived -------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:  # CostModel protocol
        """KV bytes of one token for the whole model (all layers, all TP shards)."""
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        return self.model.total_params * self.weight_bytes_per_param

    @property
    def peak_flops(self) -> float:
        """Instance peak after efficiency, FLOP/s."""
        p = self.gpu.fp8_flops if self.fp8_compute else self.gpu.bf16_flops
        return p * self.eff.compute * self.tp

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV that fit in HBM after weights (10 % kept for activations)."""
        free = self.gpu.hbm_bytes * self.tp * 0.9 - self.weight_bytes
        return max(0, int(free // self.kv_bytes_per_token))

    @property
    def prefill_attn_coeff(self) -> float:
        """The shape of its compute-bound prefill cost (the architecture's,
        :attr:`~cpd.costmodel.model_shapes.ModelShape.prefill_attn_coeff`)."""
        return self.model.prefill_attn_coeff

    def _attn_flops(self, n: float, ctx: float) -> float:
        m = self.model
        return 4.0 * m.num_layers * m.num_heads * m.head_dim * n * ctx

    def allreduce_s(self, num_tokens: int) -> float:
        """Two ring all-reduces per layer of ``num_tokens`` activations (0 when tp == 1)."""
        if self.tp <= 1 or num_tokens <= 0:
            return 0.0
        nbytes = num_tokens * self.model.hidden_size * 2
        per = 2 * (self.tp - 1) / self.tp * nbytes / (self.gpu.nvlink_bytes_per_s * self.eff.nvlink)
        return 2 * self.model.num_layers * (per + self.eff.allreduce_latency_s)

    # -- CostModel protocol ----------------------------------------------------------
    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        """Seconds to prefill ``num_new_tokens`` on top of ``num_cached_tokens`` (one step)."""
        if num_new_tokens <= 0:
            return 0.0
        return self.step_time_s(((num_new_tokens, num_cached_tokens),))

    def load_time_s(self, tier: str, num_bytes: int) -> float:
        """Seconds to load ``num_bytes`` of KV from ``L2`` (PCIe) or ``L3`` (NIC); ``L1`` is free.

        Raises:
            ValueError: unknown tier.
        """
        if tier == "L1":
            return 0.0
        return self.transfer_time_s(tier, num_bytes)

    # -- simulator helpers --------------------------------------------------------------
    def link_bytes_per_s(self, tier: str) -> float:
        """Effective bandwidth of the instance's link used by ``tier`` (``L2``=PCIe, ``L3``/``NIC``=NIC)."""
        if tier == "L2":
            return self.gpu.pcie_bytes_per_s * self.tp * self.eff.pcie
        if tier in ("L3", "NIC"):
            return self.gpu.nic_bytes_per_s * self.tp * self.eff.nic
        raise ValueError(f"unknown tier {tier!r}")

    def link_latency_s(self, tier: str) -> float:
        return self.eff.l2_latency_s if tier == "L2" else self.eff.l3_latency_s

    def transfer_time_s(self, tier: str, num_bytes: float) -> float:
        """Uncontended transfer: ``bytes / effective bandwidth + latency``."""
        return num_bytes / self.link_bytes_per_s(tier) + self.link_latency_s(tier)

    def step_time_s(self, prefill: Sequence[tuple[int, int]] = (), decode_ctx_tokens: int = 0,
                    num_decode: int = 0) -> float:
        """One engine step.

        Args:
            prefill: ``(new_tokens, cached_tokens)`` per prefill chunk in the step.
            decode_ctx_tokens: sum of context lengths of the decoding sequences.
            num_decode: number of decoding sequences (one new token each).
        Returns:
            seconds (0 for an empty step).
        """
        n_tot = num_decode
        flops = 0.0
        kv_tokens = decode_ctx_tokens
        for n, p in prefill:
            n_tot += n
            flops += self._attn_flops(n, p + n / 2.0)
            kv_tokens += p + n
        if n_tot <= 0:
            return 0.0
        flops += 2.0 * self.model.linear_params * n_tot + self._attn_flops(1, 1) * decode_ctx_tokens
        t_c = flops / self.peak_flops
        t_m = (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) / (
            self.gpu.hbm_bytes_per_s * self.eff.hbm * self.tp)
        over = self.eff.step_overhead_s if prefill else self.eff.decode_overhead_s
        return max(t_c, t_m) + self.allreduce_s(n_tot) + over

    def decode_step_time_s(self, num_seqs: int, ctx_tokens: int) -> float:
        """One decode step of ``num_seqs`` sequences with ``ctx_tokens`` total context."""
        return self.step_time_s((), ctx_tokens, num_seqs)
