"""Measured inputs of the live cost model (docs/architecture.md 'Load versus recompute').

The pure policy reads a frozen :class:`cpd.policy.routing.LinearCostModel` built from what workers
report (:meth:`CostEstimates.model`):

* **Prefill time**, by default a known *shape* and a measured *scale*. The shape
  (``attn_coeff``: a context token's attention cost relative to a token's linear cost) is the
  model architecture's, advertised by the workers (below); the scale (``prefill_tokens_per_s``:
  tokens without attention context per second, :func:`cpd.policy.routing.prefill_work_tokens`)
  is followed by an exponentially weighted moving average (EWMA, weight ``alpha`` on the newest
  sample). A sample is the engine's rate over the steps that ran while the request was computed
  (all requests of those steps together: ``step_tokens / step_s`` of the worker's answer), not
  the request's own tokens over its own time: in a batched step each request's time includes its
  batch-mates' work, so the per-request rate of a batch of ten 24-token prefills was a tenth of
  the engine's (a measured burst set the rate to 65 tokens/s). Answers without step figures (an
  append's) fall back to the request's own rate. The sample is normalised by the shape at the
  request's own context (``× (1 + attn_coeff · (p + n/2))``), so a cold prompt and a warm turn on
  a long context sample the same scale: without the shape one rate priced cold prefill of a
  60-100 K-token prompt 1.7-2.3× its time when it had been fitted on warm turns
  (docs/sim_results/adaptive_grid/session17/). Until a worker advertises a shape it is the
  ``initial`` model's (0: one plain rate); modeled workers advertise their cost model's, torch
  workers their architecture's (``cpd.worker.server.engine_cost_prior``). With
  ``fit_prefill`` (``router.prefill_cost_fit``): ``a + b·n + c·n·(p + n/2)`` (``n`` computed
  tokens on ``p`` cached; the form of :mod:`cpd.costmodel.calibrated`), fitted by the same
  weighted least squares (relative error, coefficients ≥ 0) to the last
  :data:`MAX_PREFILL_OBSERVATIONS` prefills, refitted every :data:`REFIT_EVERY` observations once
  :data:`MIN_FIT_OBSERVATIONS` are in. The fit prices a 2 K-token turn on a 100 K-token context
  and a 300-token cold prompt both right, which one rate cannot; it is not the default because
  on the simulator's Mooncake cell (docs/sim_results/adaptive_grid/README.md) adaptive routing
  sustained 7 % less with it than with the EWMA (its heavy/short split and spill rules were
  tuned on the rate). Until a fit is adopted (it needs enough observations of more than one
  shape, so that the terms are separable, and an rms relative error of at most
  :data:`MAX_FIT_RMS_REL_ERROR`) the rate follows the EWMA; after that the prefill terms change
  only by refits, and a rejected refit keeps the last one.
* **Bandwidth per tier** (L2, L3): EWMA of measured bytes / seconds.

The shape is never measured by the EWMA; it is set by the workers' advertisement until the scale
is measured (a scale is in the units of one shape: the first measurement freezes both), and by
an adopted fit.

**Start.** Until a quantity is measured, it is what the workers advertise (the ``cost_prior`` of
their ``GET /info``, :mod:`cpd.costmodel.prior`: a modeled worker's cost model × its time
dilation), averaged over the workers that advertise it (:meth:`CostEstimates.advertise`); the
configured ``initial`` value only when none does. The first measurement of a quantity continues
from that prior (it is the EWMA's old value) and ends the workers' say on it: later
advertisements (a worker that joins or restarts) no longer move a measured quantity.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Mapping

from cpd.costmodel.calibrated import fit_linear, prefill_features
from cpd.policy.routing import LinearCostModel, prefill_work_tokens

MAX_PREFILL_OBSERVATIONS = 256
"""Prefill observations kept for the fit (the newest; a bound, and a window that follows drift)."""
MIN_FIT_OBSERVATIONS = 16
REFIT_EVERY = 8
MAX_FIT_RMS_REL_ERROR = 0.5
MIN_PREFILL_TOKENS = 16
"""Smaller prefills are not observed (their time is mostly noise)."""
ADVERTISED_FIELDS = ("prefill_tokens_per_s", "attn_coeff", "l2_bytes_per_s", "l3_bytes_per_s")
"""The :class:`~cpd.policy.routing.LinearCostModel` fields a worker's ``cost_prior`` may set
(the names of :class:`cpd.messages.worker_api.CostPrior`'s figures)."""


def prefill_rate_sample(num_computed_tokens: int, compute_s: float, step_tokens: int | None,
                        step_s: float | None) -> float:
    """Tokens per second of compute: the engine's over its steps (``step_tokens / step_s``, batch
    unbiased) when given and at least the request's own tokens, else the request's own rate."""
    if step_tokens is not None and step_s is not None and step_s > 0 and step_tokens >= num_computed_tokens:
        return step_tokens / step_s
    return num_computed_tokens / compute_s


def prefill_scale_sample(num_computed_tokens: int, num_cached_tokens: int, compute_s: float,
                         step_tokens: int | None, step_s: float | None, attn_coeff: float) -> float:
    """:func:`prefill_rate_sample` in the units of the shape ``attn_coeff``: the scale
    (:func:`cpd.policy.routing.prefill_scale_tokens_per_s`) of the prefill's own context."""
    rate = prefill_rate_sample(num_computed_tokens, compute_s, step_tokens, step_s)
    work = prefill_work_tokens(num_computed_tokens, max(0, num_cached_tokens), attn_coeff)
    return rate * work / num_computed_tokens


class CostEstimates:
    """Fitted / EWMA estimates; start from ``initial`` and move with each observation."""

    def __init__(self, initial: LinearCostModel, alpha: float = 0.2, fit_prefill: bool = False):
        self._m = initial
        self._initial = initial
        self.alpha = alpha
        self.fit_prefill = fit_prefill
        self._prefills: deque[tuple[int, int, float]] = deque(maxlen=MAX_PREFILL_OBSERVATIONS)
        self._since_fit = 0
        self.fit_rms_rel_error: float | None = None  # of the fit in use (None: EWMA only so far)
        self._advertised: dict[str, dict[str, float]] = {}  # worker id -> field -> advertised value
        self.measured: set[str] = set()  # LinearCostModel fields set by a measurement so far

    def advertise(self, worker_id: str, values: Mapping[str, float | None] | None) -> None:
        """``worker_id`` expects these costs (``prefill_tokens_per_s``, ``attn_coeff``,
        ``l2_bytes_per_s``, ``l3_bytes_per_s``; wall-clock; a ``None`` value or ``values=None``: no
        expectation, also withdraws an earlier one). Each field not measured yet becomes the mean
        over the workers that advertise it, or the ``initial`` value when none does
        (``attn_coeff``: until the scale ``prefill_tokens_per_s`` is measured)."""
        clean = {f: float(v) for f, v in (values or {}).items()
                 if f in ADVERTISED_FIELDS and v is not None and (v > 0 or (f == "attn_coeff" and v == 0))}
        if clean:
            self._advertised[worker_id] = clean
        else:
            self._advertised.pop(worker_id, None)
        self._apply_advertised()

    def forget(self, worker_id: str) -> None:
        """``worker_id`` left (refused, removed): its advertisement no longer counts."""
        if self._advertised.pop(worker_id, None) is not None:
            self._apply_advertised()

    def prior(self, name: str) -> float:
        """The start value of field ``name`` now: the advertised mean, else the initial value."""
        vals = [a[name] for a in self._advertised.values() if name in a]
        return sum(vals) / len(vals) if vals else float(getattr(self._initial, name))

    def _apply_advertised(self) -> None:
        todo = set(ADVERTISED_FIELDS) - self.measured
        if "prefill_tokens_per_s" not in todo:  # the measured scale is in the units of the shape in use
            todo.discard("attn_coeff")
        v = {f: self.prior(f) if f in todo else float(getattr(self._m, f)) for f in ADVERTISED_FIELDS}
        self._m = replace(self._m, prefill_tokens_per_s=v["prefill_tokens_per_s"], attn_coeff=v["attn_coeff"],
                          l2_bytes_per_s=v["l2_bytes_per_s"], l3_bytes_per_s=v["l3_bytes_per_s"])

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def observe_prefill(self, num_computed_tokens: int, num_cached_tokens: int, compute_s: float,
                        step_tokens: int | None = None, step_s: float | None = None) -> None:
        """One prefill: ``num_computed_tokens`` computed on ``num_cached_tokens`` already cached, in
        ``compute_s`` seconds of compute (queueing and prefix loads excluded); ``step_tokens`` /
        ``step_s`` (when the worker reports them): tokens and seconds of the engine steps that ran
        while it was computed, batch-mates included: the rate sample of the EWMA, normalised by the
        shape at this prefill's context (:func:`prefill_scale_sample`)."""
        if num_computed_tokens < MIN_PREFILL_TOKENS or compute_s <= 0:
            return
        if self.fit_prefill:
            self._prefills.append((int(num_computed_tokens), max(0, int(num_cached_tokens)), float(compute_s)))
            self._since_fit += 1
            if len(self._prefills) >= MIN_FIT_OBSERVATIONS and self._since_fit >= REFIT_EVERY and self._refit():
                return
        if self.fit_rms_rel_error is None:
            rate = prefill_scale_sample(num_computed_tokens, num_cached_tokens, compute_s, step_tokens, step_s,
                                        self._m.attn_coeff)
            self._m = replace(self._m, prefill_tokens_per_s=self._ewma(self._m.prefill_tokens_per_s, rate))
            self.measured.add("prefill_tokens_per_s")

    def _refit(self) -> bool:
        """Fit the prefill terms to the window; True when the fit was adopted."""
        self._since_fit = 0
        rows = [prefill_features(n, p) for n, p, _ in self._prefills]
        try:
            (a, b, c), stats = fit_linear(rows, [t for _, _, t in self._prefills])
        except ValueError:  # singular: every observation of one shape
            return False
        if b <= 0 or stats["rms_rel_error"] > MAX_FIT_RMS_REL_ERROR:
            return False
        self._m = replace(self._m, prefill_overhead_s=a, prefill_tokens_per_s=1.0 / b, attn_coeff=c / b)
        self.fit_rms_rel_error = float(stats["rms_rel_error"])
        self.measured.update(("prefill_tokens_per_s", "attn_coeff"))
        return True

    def observe_transfer(self, tier: str, num_bytes: int, seconds: float) -> None:
        """One measured load from ``tier`` (``L2`` or ``L3``)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        bw = num_bytes / seconds
        if tier == "L2":
            self._m = replace(self._m, l2_bytes_per_s=self._ewma(self._m.l2_bytes_per_s, bw))
            self.measured.add("l2_bytes_per_s")
        elif tier == "L3":
            self._m = replace(self._m, l3_bytes_per_s=self._ewma(self._m.l3_bytes_per_s, bw))
            self.measured.add("l3_bytes_per_s")

    def model(self) -> LinearCostModel:
        return self._m
