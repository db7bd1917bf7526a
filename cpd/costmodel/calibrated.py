"""A cost model calibrated on a real engine: measured step times of one model on one machine.

``benchmarks/calibrate_engine.py`` times the real engine's steps (torch executor) over a grid
and fits the small linear models below by weighted least squares (weights ``1/t``: the fit
minimises *relative* error, so short steps count as much as long ones). The profile (JSON,
``cpd/costmodel/profiles/``) holds the coefficients, the fit statistics and the raw points;
:class:`CalibratedCostModel` loads it and answers the same questions as
:class:`cpd.policy.cost_model.RooflineCostModel`, so the modeled executor and the simulator
can run "this model on this machine".

Step time (seconds) of one engine step:

* prefill chunks ``(n_i new, p_i cached)`` only::

      t = a + Σ_i [ b·n_i + c·n_i·(p_i + n_i/2) + g·p_i ]

  ``g`` is per cached token a chunk reads, whatever its own length: the engine copies a cached
  prefix into the sequence's contiguous KV row before attending (``cpd.engine.seq_kv``) and
  attention streams it. Without it, short chunks on long prefixes fit 2× low (AMD profile:
  rms relative residual 20 % → 4.5 %). Profiles from before it have no ``g`` (read as 0).

* decode only, ``B`` sequences with total context ``C = Σ c_j``::

      t = d + e·B + f·C

* both in one step: ``a + Σ_i[...] + e·B + f·C`` (one fixed overhead: it is one forward).

The router's learned prefill model (:mod:`cpd.router.estimates`) fits the first three prefill
terms only (:func:`prefill_features`): :class:`~cpd.policy.routing.LinearCostModel` has no
per-cached-token term.

Transfers (``L2`` host pool → L1, ``L3`` store → L1, ``NIC`` handoff): ``bytes / bytes_per_s +
latency_s`` from the profile's ``transfer`` section; a tier the profile did not measure raises
``KeyError`` (no invented figure). ``L1`` loads are free.

Profile format (``format: cpd-calibrated-cost-model/1``)::

    {"format", "model": {ModelShape fields, "kv_dtype_bytes"},
     "machine": {"host", "cpu", "threads", "torch", "dtype", ...},
     "prefill": {"coef": {"a_s", "b_s_per_token", "c_s_per_token_ctx"[, "g_s_per_cached_token"]}, "fit": {...}},
     "decode": {"coef": {"d_s", "e_s_per_seq", "f_s_per_ctx_token"}, "fit": {...}},
     "transfer": {"L2": {"bytes_per_s", "latency_s"}, ...},
     "points": [{"kind": "prefill", "n", "p", "t_s"} | {"kind": "decode", "b", "c", "t_s"}, ...]}

``fit`` holds ``r2``, ``rms_rel_error`` and ``max_rel_error`` over the points it was fitted on.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from cpd.costmodel.model_shapes import ModelShape

FORMAT = "cpd-calibrated-cost-model/1"
PREFILL_COEFS = ("a_s", "b_s_per_token", "c_s_per_token_ctx")
PREFIX_COEF = "g_s_per_cached_token"  # optional (profiles before it: 0)
DECODE_COEFS = ("d_s", "e_s_per_seq", "f_s_per_ctx_token")
TIERS = ("L2", "L3", "NIC")


class ProfileError(ValueError):
    """A calibration profile that cannot be used (missing or malformed field), naming the file."""


# -- features and fitting (one truth: the formulas of the module docstring) ---------------------
def prefill_features(n: int, p: int) -> list[float]:
    """``[1, n, n·(p + n/2)]`` of one prefill chunk of ``n`` new tokens on ``p`` cached."""
    return [1.0, float(n), n * (p + n / 2.0)]


def prefill_step_features(n: int, p: int) -> list[float]:
    """:func:`prefill_features` and ``p`` (the cached tokens the chunk reads): what a profile fits."""
    return [*prefill_features(n, p), float(p)]


def decode_features(b: int, c_total: int) -> list[float]:
    """``[1, B, C]`` of a decode step of ``B`` sequences with ``C`` context tokens in all."""
    return [1.0, float(b), float(c_total)]


def _solve(rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Least squares of ``rows · x ≈ ys`` with row weights (normal equations, Gaussian elimination)."""
    k = len(rows[0])
    ata = [[0.0] * k for _ in range(k)]
    aty = [0.0] * k
    for r, y, w in zip(rows, ys, weights):
        w2 = w * w
        for i in range(k):
            aty[i] += w2 * r[i] * y
            for j in range(k):
                ata[i][j] += w2 * r[i] * r[j]
    m = [ata[i] + [aty[i]] for i in range(k)]
    for col in range(k):
        piv = max(range(col, k), key=lambda i: abs(m[i][col]))
        if abs(m[piv][col]) < 1e-300:
            raise ValueError("singular fit: the points do not determine every coefficient")
        m[col], m[piv] = m[piv], m[col]
        for i in range(k):
            if i != col:
                f = m[i][col] / m[col][col]
                m[i] = [a - f * b for a, b in zip(m[i], m[col])]
    return [m[i][k] / m[i][i] for i in range(k)]


def fit_linear(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> tuple[list[float], dict[str, Any]]:
    """Fit ``y ≈ rows · x`` minimising relative error (weights ``1/y``), with every coefficient
    ≥ 0: a coefficient that comes out negative is pinned to 0 and the rest refitted.

    Returns:
        ``(coefficients, {"r2", "rms_rel_error", "max_rel_error", "rel_residuals"})``; R² is the
        ordinary (unweighted) one of ``y``; a relative residual is ``(fit - y) / y``.
    Raises:
        ValueError: fewer points than coefficients, a non-positive ``y``, or a singular fit.
    """
    k = len(rows[0]) if rows else 0
    if len(rows) < k or not rows:
        raise ValueError(f"need at least {k} points to fit {k} coefficients, got {len(rows)}")
    if any(y <= 0 for y in ys):
        raise ValueError("step times must be > 0")
    active = list(range(k))
    while True:
        sub = [[r[i] for i in active] for r in rows]
        x_act = _solve(sub, ys, [1.0 / y for y in ys])
        neg = [i for i, v in zip(active, x_act) if v < 0]
        if not neg or len(active) == 1:
            break
        active = [i for i in active if i not in neg]
    coef = [0.0] * k
    for i, v in zip(active, x_act):
        coef[i] = max(0.0, v)
    pred = [sum(c * f for c, f in zip(coef, r)) for r in rows]
    mean = sum(ys) / len(ys)
    ss_tot = sum((y - mean) ** 2 for y in ys)
    ss_res = sum((y - q) ** 2 for y, q in zip(ys, pred))
    rel = [(q - y) / y for y, q in zip(ys, pred)]
    stats = {"r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
             "rms_rel_error": math.sqrt(sum(e * e for e in rel) / len(rel)),
             "max_rel_error": max(abs(e) for e in rel), "rel_residuals": rel}
    return coef, stats


def fit_profile(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``prefill`` and ``decode`` sections (coefficients and fit statistics) of ``points``
    (``{"kind": "prefill", "n", "p", "t_s"}`` / ``{"kind": "decode", "b", "c", "t_s"}``; ``c`` is
    the context per sequence, so ``C = b·c``)."""
    pre = [q for q in points if q["kind"] == "prefill"]
    dec = [q for q in points if q["kind"] == "decode"]
    out: dict[str, Any] = {}
    for name, pts, feats, names in (
            ("prefill", pre, lambda q: prefill_step_features(q["n"], q["p"]), (*PREFILL_COEFS, PREFIX_COEF)),
            ("decode", dec, lambda q: decode_features(q["b"], q["b"] * q["c"]), DECODE_COEFS)):
        coef, stats = fit_linear([feats(q) for q in pts], [float(q["t_s"]) for q in pts])
        out[name] = {"coef": dict(zip(names, coef)), "fit": stats}
    return out


# -- the model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibratedDevice:
    """What the modeled executor names the hardware by (``weights_digest``)."""

    name: str


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float


def _req(d: Mapping[str, Any], key: str, where: str, path: str) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise ProfileError(f"{path}: missing {where}{key}")
    return d[key]


def _num(d: Mapping[str, Any], key: str, where: str, path: str) -> float:
    v = _req(d, key, where, path)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ProfileError(f"{path}: {where}{key} must be a finite number >= 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class CalibratedCostModel:
    """Step and transfer times of one model on one machine, from a calibration profile.

    Implements :class:`cpd.policy.routing.CostModel` and what :class:`ModeledExecutor` and the
    simulator read from :class:`~cpd.policy.cost_model.RooflineCostModel` (``model``, ``gpu``,
    ``tp``, ``step_time_s``, ``transfer_time_s``, ``link_bytes_per_s``, ``link_latency_s``,
    ``kv_capacity_tokens``). Build with :meth:`load`.
    """

    model: ModelShape
    kv_dtype_bytes: float
    prefill_coef: tuple[float, float, float, float]  # a, b, c, g
    decode_coef: tuple[float, float, float]
    links: Mapping[str, Link]
    gpu: CalibratedDevice
    profile: Mapping[str, Any]
    tp: int = 1
    kv_capacity_tokens: int = 0  # not a property of the calibration: the engine's L1 size decides

    @classmethod
    def load(cls, path: str | Path) -> "CalibratedCostModel":
        """Read a profile written by ``benchmarks/calibrate_engine.py``.

        Raises:
            ProfileError: not JSON, wrong ``format``, or a missing / non-numeric field (named).
            FileNotFoundError: no such file.
        """
        p = str(path)
        try:
            doc = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ProfileError(f"{p}: not JSON ({e})") from None
        return cls.from_dict(doc, p)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], path: str = "<profile>") -> "CalibratedCostModel":
        """As :meth:`load`, from the parsed document."""
        if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, Mapping) else type(doc).__name__
            raise ProfileError(f"{path}: format must be {FORMAT!r}, got {got!r}")
        m = _req(doc, "model", "", path)
        shape_kw: dict[str, Any] = {}
        for f in fields(ModelShape):
            if f.name == "tie_word_embeddings":
                shape_kw[f.name] = bool(m.get(f.name, False)) if isinstance(m, Mapping) else False
            elif f.name == "name":
                shape_kw[f.name] = str(_req(m, "name", "model.", path))
            else:
                v = _num(m, f.name, "model.", path)
                if v < 1 or v != int(v):
                    raise ProfileError(f"{path}: model.{f.name} must be a positive integer, got {v!r}")
                shape_kw[f.name] = int(v)
        kv_bytes = _num(m, "kv_dtype_bytes", "model.", path)
        pre = _req(_req(doc, "prefill", "", path), "coef", "prefill.", path)
        dec = _req(_req(doc, "decode", "", path), "coef", "decode.", path)
        pc = tuple(_num(pre, k, "prefill.coef.", path) for k in PREFILL_COEFS)
        g = _num(pre, PREFIX_COEF, "prefill.coef.", path) if PREFIX_COEF in pre else 0.0
        dc = tuple(_num(dec, k, "decode.coef.", path) for k in DECODE_COEFS)
        links = {}
        for tier, v in (doc.get("transfer") or {}).items():
            if tier not in TIERS:
                raise ProfileError(f"{path}: transfer.{tier}: unknown tier (known: {', '.join(TIERS)})")
            bw = _num(v, "bytes_per_s", f"transfer.{tier}.", path)
            if bw <= 0:
                raise ProfileError(f"{path}: transfer.{tier}.bytes_per_s must be > 0")
            links[tier] = Link(bw, _num(v, "latency_s", f"transfer.{tier}.", path))
        mach = doc.get("machine") or {}
        dev = CalibratedDevice(f"calibrated:{mach.get('host', '?')}:{mach.get('dtype', '?')}:"
                               f"t{mach.get('threads', '?')}")
        return cls(ModelShape(**shape_kw), kv_bytes, (pc[0], pc[1], pc[2], g), (dc[0], dc[1], dc[2]), links, dev, doc)

    # -- CostModel protocol ----------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token (all layers, K and V) at the calibrated dtype."""
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes)

    @property
    def prefill_attn_coeff(self) -> float:
        """The shape of its prefill cost: the fitted attention term over the per-token one
        (``c / b``; 0 when the profile has no per-token term)."""
        _, b, c, _ = self.prefill_coef
        return c / b if b > 0 else 0.0

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        """One step computing ``num_new_tokens`` on ``num_cached_tokens`` (0 for no tokens)."""
        if num_new_tokens <= 0:
            return 0.0
        return self.step_time_s(((num_new_tokens, num_cached_tokens),))

    def load_time_s(self, tier: str, num_bytes: int) -> float:
        """``L1`` is free; ``L2``/``L3`` as :meth:`transfer_time_s`."""
        if tier == "L1":
            return 0.0
        return self.transfer_time_s(tier, num_bytes)

    # -- engine / simulator -----------------------------------------------------------------
    def step_time_s(self, prefill: Sequence[tuple[int, int]] = (), decode_ctx_tokens: int = 0,
                    num_decode: int = 0) -> float:
        """One engine step (module docstring); 0 for an empty step."""
        a, b, c, g = self.prefill_coef
        d, e, f = self.decode_coef
        chunks = [(n, p) for n, p in prefill if n > 0]
        if not chunks and num_decode <= 0:
            return 0.0
        t = e * num_decode + f * decode_ctx_tokens
        if not chunks:
            return d + t
        return a + t + sum(b * n + c * n * (p + n / 2.0) + g * p for n, p in chunks)

    def decode_step_time_s(self, num_seqs: int, ctx_tokens: int) -> float:
        """One decode step of ``num_seqs`` sequences with ``ctx_tokens`` total context."""
        return self.step_time_s((), ctx_tokens, num_seqs)

    def link_bytes_per_s(self, tier: str) -> float:
        """Measured bandwidth of ``tier``. Raises ``KeyError`` for a tier the profile lacks."""
        return self._link(tier).bytes_per_s

    def link_latency_s(self, tier: str) -> float:
        return self._link(tier).latency_s

    def transfer_time_s(self, tier: str, num_bytes: float) -> float:
        """``bytes / bytes_per_s + latency_s`` of the measured ``tier``."""
        ln = self._link(tier)
        return num_bytes / ln.bytes_per_s + ln.latency_s

    def _link(self, tier: str) -> Link:
        ln = self.links.get(tier)
        if ln is None:
            raise KeyError(f"tier {tier!r} was not measured in this profile (measured: {sorted(self.links)})")
        return ln

    def with_l1_capacity(self, num_tokens: int) -> "CalibratedCostModel":
        """A copy whose ``kv_capacity_tokens`` is ``num_tokens`` (the engine's L1 size)."""
        from dataclasses import replace
        return replace(self, kv_capacity_tokens=int(num_tokens))

    def scaled(self, factor: float) -> "CalibratedCostModel":
        """A copy whose every time (steps and transfers) is ``factor`` times longer: the machine
        slowed down by others sharing it (``factor`` measured at the time, see
        ``benchmarks/predict_live_ttft.py``). Raises ``ValueError`` for ``factor <= 0``."""
        from dataclasses import replace
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        p, d = self.prefill_coef, self.decode_coef
        return replace(self, prefill_coef=(p[0] * factor, p[1] * factor, p[2] * factor, p[3] * factor),
                       decode_coef=(d[0] * factor, d[1] * factor, d[2] * factor),
                       links={t: Link(ln.bytes_per_s / factor, ln.latency_s * factor) for t, ln in self.links.items()})
