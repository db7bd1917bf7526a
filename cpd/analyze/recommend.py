"""``cpd analyze`` recommendation: which configuration to run and how to size its pools, from the
machinery the router and the simulator use (no formula of its own where one exists there).

Rules (pure functions, tested on constructed inputs):

1. **Classes** (:func:`class_work`): a request's own work is the adaptive policy's ``own_s``
   (:func:`cpd.policy.routing.work_s` of :func:`cpd.policy.routing.plan_loads`) on the worker that
   holds its cached prefix in L1 (the policy's smallest ``own_s``, rule A2; a prefix only in L2/L3
   would add its load time), priced with the router's cost model. It is *heavy* (``cold``, homed
   on the pre-prefill pool) when that exceeds :func:`cpd.policy.routing.heavy_uncached_s` (a quarter of
   the TTFT SLO by default), else *short* (``warm``, homed on the prefill pool).
2. **Pre-prefill / prefill split** (:func:`split_prefill_side`): the role planner's target
   (:mod:`cpd.policy.roles` rules 1-3a): demand per pool = the work rate of the class homed
   there; among the splits that keep both pool minimums (rule 2), the one with the smallest larger
   per-worker load ``max(cold / n_pre, warm / n_prefill)`` (ties: fewer pre-prefill workers). No
   single move from it lowers that maximum, so the live planner started there leaves it
   (:func:`planner_settles` checks it with :func:`cpd.policy.roles.plan_roles` itself). Both
   rates scale with the load, so the split does not depend on it; only the planner's busy rule
   (3b) does. Per window of the trace (:func:`window_splits`) the same rule shows whether the
   target moves as the mix changes, i.e. whether elastic roles have anything to do.
3. **Decode pool**: nodes in proportion to modeled busy time (GPU-seconds per request of the
   decode step at the decode batch vs of the prefill side), at least one, leaving at least two
   prefill-side nodes (:func:`decode_nodes`).
4. **Configuration** (:func:`choose`): the highest mean saturation QPS/GPU
   (:func:`cpd.sim.sweep.compare` on the trace, same GPUs for every configuration); ties on the
   mean go to the simpler configuration (:data:`CONFIG_ORDER`). The choice is *separated* from
   the runner-up only with at least two seeds that gave different saturations (identical seeds:
   the replay does not vary with the seed, e.g. a timed trace, and measure no spread) and
   disjoint 95 % intervals, and only when neither saturation is a bound (``at-least`` /
   ``below``); otherwise the report says it is not.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cpd.policy.roles import PlannerConfig, PlannerState, PoolWindow, RoleObservation, plan_roles
from cpd.policy.routing import CostModel, PrefixMatch, RoutingConfig, WorkerLoad, heavy_uncached_s, plan_loads, work_s
from cpd.types import Role

CONFIG_ORDER = ("pd", "pd-l3", "cpd-static", "cpd", "cpd-elastic")
"""Configurations the recommendation compares, simplest first (tie-break of :func:`choose`)."""

ELASTIC = "cpd-elastic"
_HOLDER = "holder"


@dataclass(frozen=True)
class ClassWork:
    """A trace's prefill work as the adaptive policy classes it (rule 1).

    Attributes:
        heavy_uncached_s: the threshold used (s).
        num_requests / num_heavy: requests, and those classed heavy (``cold``).
        cold_work_s / warm_work_s: summed own work of heavy / short requests (s).
    """

    heavy_uncached_s: float
    num_requests: int
    num_heavy: int
    cold_work_s: float
    warm_work_s: float

    def rates(self, total_qps: float) -> tuple[float, float]:
        """(cold, warm) work per second (s/s) at ``total_qps`` requests per second."""
        n = max(1, self.num_requests)
        return self.cold_work_s / n * total_qps, self.warm_work_s / n * total_qps

    @property
    def cold_share(self) -> float:
        """Heavy work / all work (0 without work)."""
        tot = self.cold_work_s + self.warm_work_s
        return self.cold_work_s / tot if tot > 0 else 0.0


def own_work_s(num_prompt_tokens: int, num_cached_tokens: int, cfg: RoutingConfig, cost: CostModel) -> float:
    """The policy's ``own_s`` of one request whose ``num_cached_tokens`` leading tokens sit in the
    L1 of the worker it runs on (rule 1)."""
    match = PrefixMatch(l1={_HOLDER: num_cached_tokens // cfg.block_size})
    plan, _ = plan_loads(_HOLDER, match, num_prompt_tokens, cfg, cost)
    return work_s(plan, num_prompt_tokens, cfg, cost)


def class_work(prompt_tokens: Sequence[int], cached_tokens: Sequence[int], cfg: RoutingConfig,
               cost: CostModel) -> ClassWork:
    """Class every request by its own work against ``heavy_uncached_s(cfg)`` (rule 1)."""
    if len(prompt_tokens) != len(cached_tokens):
        raise ValueError("one cached-token count per request is needed")
    return classify([own_work_s(p, c, cfg, cost) for p, c in zip(prompt_tokens, cached_tokens)],
                    heavy_uncached_s(cfg))


def classify(own_s: Sequence[float], heavy_threshold_s: float) -> ClassWork:
    """Requests' own work summed per class: heavy when above ``heavy_threshold_s``."""
    cold = sum(x for x in own_s if x > heavy_threshold_s)
    heavy = sum(1 for x in own_s if x > heavy_threshold_s)
    return ClassWork(heavy_threshold_s, len(own_s), heavy, cold, sum(own_s) - cold)


def window_splits(arrival_s: Sequence[float], own_s: Sequence[float], heavy_threshold_s: float, window_s: float,
                  num_workers: int, cfg: PlannerConfig = PlannerConfig()) -> list[int]:
    """The planner's target (:func:`split_prefill_side`) in each ``window_s`` window of arrivals
    that holds work, in time order: where elastic roles would move the pools as the mix changes
    (the live planner measures its rates over such a window, ``router.role_window_s``)."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    if not arrival_s:
        return []
    t0 = min(arrival_s)
    buckets: dict[int, list[float]] = {}
    for t, x in zip(arrival_s, own_s):
        buckets.setdefault(int((t - t0) // window_s), []).append(x)
    out = []
    for k in sorted(buckets):
        cw = classify(buckets[k], heavy_threshold_s)
        if cw.cold_work_s + cw.warm_work_s > 0:
            out.append(split_prefill_side(cw.cold_work_s, cw.warm_work_s, num_workers, cfg).pre_prefill)
    return out


@dataclass(frozen=True)
class PoolSplit:
    """Prefill-side workers per role and their per-worker loads (s of work per s)."""

    pre_prefill: int
    prefill: int
    load_pre_prefill: float
    load_prefill: float


def _per_worker(demand_s_per_s: float, n: int) -> float:
    """Planner rule 1: demand per worker, infinite for an empty pool with demand."""
    if n > 0:
        return demand_s_per_s / n
    return math.inf if demand_s_per_s > 0 else 0.0


def split_prefill_side(cold_s_per_s: float, warm_s_per_s: float, num_workers: int,
                       cfg: PlannerConfig = PlannerConfig()) -> PoolSplit:
    """Rule 2 of the module docstring: the split minimising the larger per-worker load within the
    planner's pool minimums. Raises ValueError when ``num_workers`` cannot hold both minimums."""
    cold, warm = max(0.0, cold_s_per_s), max(0.0, warm_s_per_s)
    lo, hi = cfg.min_pre_prefill, num_workers - cfg.min_prefill
    if lo > hi:
        raise ValueError(f"{num_workers} prefill-side workers cannot hold {cfg.min_pre_prefill} pre-prefill "
                         f"and {cfg.min_prefill} prefill")
    k = min(range(lo, hi + 1), key=lambda n: (max(_per_worker(cold, n), _per_worker(warm, num_workers - n)), n))
    return PoolSplit(k, num_workers - k, _per_worker(cold, k), _per_worker(warm, num_workers - k))


@dataclass(frozen=True)
class Settled:
    """Where the live planner, fed constant rates, leaves the pools (:func:`planner_settles`)."""

    pre_prefill: int
    prefill: int
    reasons: tuple[str, ...] = field(default_factory=tuple)


def planner_settles(cold_s_per_s: float, warm_s_per_s: float, num_workers: int, start_pre_prefill: int,
                    cfg: PlannerConfig = PlannerConfig()) -> Settled:
    """Run :func:`cpd.policy.roles.plan_roles` on constant rates from ``start_pre_prefill``
    pre-prefill workers, one round per ``max(interval_s, min_dwell_s)`` (every worker past its
    dwell), until it changes nothing. The pools are measured as meeting their SLO with no wait
    (no measurement contradicts the rates), so only rules 1-3a/3b decide."""
    pre = start_pre_prefill
    state = PlannerState()
    step = max(cfg.interval_s, cfg.min_dwell_s)
    reasons: list[str] = []
    for r in range(2 * num_workers + 2):  # each move lowers the larger load: at most num_workers moves
        roles = [Role.PRE_PREFILL] * pre + [Role.PREFILL] * (num_workers - pre)
        workers = [WorkerLoad(f"w{i}", role) for i, role in enumerate(roles)]
        demand = {Role.PRE_PREFILL: cold_s_per_s, Role.PREFILL: warm_s_per_s}
        pools = {role: PoolWindow(role, roles.count(role), demand[role], 0.0, 1.0) for role in demand}
        obs = RoleObservation((r + 1) * step, pools, workers, cold_s_per_s, warm_s_per_s)
        changes, state = plan_roles(obs, state, cfg)
        if not changes:
            break
        for c in changes:
            pre += 1 if c.to_role == Role.PRE_PREFILL else -1
            reasons.append(c.reason)
    return Settled(pre, num_workers - pre, tuple(reasons))


def decode_nodes(prefill_gpu_s_per_request: float, decode_gpu_s_per_request: float, total_gpus: int,
                 decode_node_gpus: int, prefill_worker_gpus: int, min_prefill_workers: int = 2) -> int:
    """Rule 3: decode nodes ∝ modeled decode busy time (GPU-seconds per request; rounded, at least
    1, leaving GPUs for ``min_prefill_workers`` prefill-side workers). Raises ValueError when
    ``total_gpus`` cannot hold one decode node and those workers."""
    room = (total_gpus - min_prefill_workers * prefill_worker_gpus) // decode_node_gpus
    if room < 1:
        raise ValueError(f"{total_gpus} GPUs cannot hold {min_prefill_workers} prefill-side workers of "
                         f"{prefill_worker_gpus} GPUs and a decode node of {decode_node_gpus}")
    tot = prefill_gpu_s_per_request + decode_gpu_s_per_request
    share = decode_gpu_s_per_request / tot if tot > 0 else 0.0
    return min(room, max(1, round(share * total_gpus / decode_node_gpus)))


@dataclass(frozen=True)
class Choice:
    """Outcome of :func:`choose`.

    Attributes:
        config: the chosen configuration (highest mean saturation).
        runner_up: the next one (None with a single configuration).
        separated: True only when the two are told apart (rule 4).
        why: one sentence stating the figures it rests on.
        within_interval: configurations whose interval overlaps the chosen one's (simplest first).
    """

    config: str
    runner_up: str | None
    separated: bool
    why: str
    within_interval: tuple[str, ...] = ()


def _order(name: str) -> int:
    return CONFIG_ORDER.index(name) if name in CONFIG_ORDER else len(CONFIG_ORDER)


def _fmt(d: Mapping[str, Any]) -> str:
    x = d.get("saturation_qps_per_gpu")
    if x is None:
        return "—"
    s = (">= " if d.get("at_least") else "") + f"{x:.3f}"
    if d.get("n_seeds", 1) >= 2 and d.get("ci"):
        lo, hi = d["ci"]
        s += f" [{lo:.3f}, {hi:.3f}]"
    return s


def seeds_vary(d: Mapping[str, Any]) -> bool:
    """The seeds gave different saturations (an interval of zero width from identical seeds
    measures no spread: the workload did not vary with the seed)."""
    per = d.get("per_seed")
    if per:
        return len(set(per)) > 1
    lo, hi = d.get("ci") or (None, None)
    return lo is not None and hi is not None and hi > lo


def choose(configs: Mapping[str, Mapping[str, Any]]) -> Choice:
    """Rule 4 on ``compare()["configs"]`` (``saturation_qps_per_gpu``, ``ci``, ``n_seeds``,
    ``at_least``, ``below_lowest``)."""
    if not configs:
        raise ValueError("no configuration to choose from")
    sat = {c: (d.get("saturation_qps_per_gpu") or 0.0) for c, d in configs.items()}
    ranked = sorted(configs, key=lambda c: (-sat[c], _order(c)))
    best = ranked[0]
    b = configs[best]
    if len(ranked) == 1:
        return Choice(best, None, False, f"{best} {_fmt(b)} QPS/GPU is the only configuration simulated",
                      (best,))
    ru = ranked[1]
    r = configs[ru]

    def bounded(d: Mapping[str, Any]) -> bool:
        return not d.get("at_least") and not d.get("below_lowest")

    def interval(d: Mapping[str, Any]) -> tuple[float, float]:
        lo, hi = d.get("ci") or (None, None)
        x = d.get("saturation_qps_per_gpu") or 0.0
        return (x if lo is None else lo, x if hi is None else hi)
    lo_b, hi_b = interval(b)
    within = tuple(sorted((c for c in ranked if interval(configs[c])[1] >= lo_b), key=_order))
    seeds = min(int(b.get("n_seeds", 1)), int(r.get("n_seeds", 1)))
    varied = seeds_vary(b) or seeds_vary(r)
    sep = seeds >= 2 and varied and bounded(b) and bounded(r) and lo_b > interval(r)[1]
    figs = f"{best} {_fmt(b)} vs {ru} {_fmt(r)} QPS/GPU"
    if sep:
        why = f"{figs}: the 95 % intervals are disjoint"
    elif not (bounded(b) and bounded(r)):
        why = (f"{figs}: not separated from {ru} (a saturation is only a bound of the searched loads; "
               "rerun with other --sim-loads)")
    elif seeds < 2:
        why = f"{figs}: not separated from {ru} (one seed gives no interval; rerun with --sim-seeds 3)"
    elif not varied:
        why = (f"{figs}: not separated from {ru} (every seed gave the same saturation: the replay does not vary "
               "with the seed, as a timed trace replays the same arrivals, so the seeds measure no spread)")
    else:
        why = f"{figs}: not separated from {ru} (the 95 % intervals overlap)"
    return Choice(best, ru, sep, why, within)


def serve_flags(config: str, pools: Mapping[str, int], ttft_slo_s: float, tpot_slo_s: float) -> list[str]:
    """The ``cpd serve`` flags of ``config`` (:data:`CONFIG_ORDER`) with ``pools`` workers per role
    (``pre-prefill``, ``prefill``, ``decode``); ``pd`` configurations put every prefill-side
    worker in the prefill pool and route statically, as the simulated ``pd`` baselines do (the
    live default routing mode is adaptive)."""
    side = pools["pre-prefill"] + pools["prefill"]
    if config in ("pd", "pd-l3"):
        f = ["--topology", "pd", "--prefill", str(side), "--decode", str(pools["decode"]), "--routing-mode", "static"]
        return f + (["--write-through", "all"] if config == "pd-l3" else [])
    if config not in ("cpd-static", "cpd", ELASTIC):
        raise ValueError(f"unknown configuration {config!r} (known: {', '.join(CONFIG_ORDER)})")
    f = ["--topology", "cpd", "--pre-prefill", str(pools["pre-prefill"]), "--prefill", str(pools["prefill"]),
         "--decode", str(pools["decode"])]
    if config == "cpd-static":
        return f + ["--routing-mode", "static"]
    f += ["--routing-mode", "adaptive", "--ttft-slo", f"{ttft_slo_s:g}", "--tpot-slo", f"{tpot_slo_s:g}"]
    return f + (["--elastic"] if config == ELASTIC else [])


def sim_configs(names: Sequence[str], pre_prefill: int, prefill: int, decode: int) -> dict[str, dict[str, Any]]:
    """Experiment ``configs`` entries of ``names`` on the recommended pools (nodes; the ``pd`` ones
    put every prefill-side node in the prefill pool); ``cpd-elastic`` is adaptive ``cpd`` with the
    roles planner at its defaults (:class:`cpd.policy.roles.PlannerConfig`)."""
    cpd_pools = {"pre_prefill": pre_prefill, "prefill": prefill, "decode": decode}
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        if n in ("pd", "pd-l3"):
            out[n] = {"pre_prefill": 0, "prefill": pre_prefill + prefill, "decode": decode}
        elif n in ("cpd-static", "cpd"):
            out[n] = dict(cpd_pools)
        elif n == ELASTIC:
            out[n] = {"topology": "cpd", "mode": "adaptive", **cpd_pools,
                      "elastic": {"interval_s": PlannerConfig().interval_s}}
        else:
            raise ValueError(f"unknown configuration {n!r} (known: {', '.join(CONFIG_ORDER)})")
    return out


def cpd_verdict(configs: Mapping[str, Mapping[str, Any]]) -> str:
    """Whether CPD pays against plain P/D on these saturations (``compare()["configs"]``).

    "CPD pays" only when the best CPD configuration's saturation and pd's are both bounded by the
    searched loads, the CPD one is more than 5 % higher, and (two or more seeds) their 95 %
    intervals are disjoint (seeds that all gave the same saturation count as one); "does not pay"
    when both are bounded and the CPD one is at most 5 % higher; otherwise "no supported verdict"."""
    cpds = [c for c in configs if c.startswith("cpd")]
    if "pd" not in configs or not cpds:
        return "* **no supported verdict**: pd and a CPD configuration must both be simulated."
    best = max(cpds, key=lambda c: (configs[c].get("saturation_qps_per_gpu") or 0.0, -_order(c)))
    b, p = configs[best], configs["pd"]

    def bounded(d: Mapping[str, Any]) -> bool:
        return d.get("saturation_qps_per_gpu") is not None and not d.get("at_least") and not d.get("below_lowest")
    figs = f"{best} {_fmt(b)} vs pd {_fmt(p)} QPS/GPU"
    if not (bounded(b) and bounded(p)):
        return f"* **no supported verdict**: the searched loads do not bound both saturations ({figs})."
    g = b["saturation_qps_per_gpu"] / p["saturation_qps_per_gpu"] - 1 if p["saturation_qps_per_gpu"] else math.inf
    if g <= 0.05:
        return f"* **CPD does not pay here**: {figs} ({g * 100:+.0f} %)."
    seeds = min(int(b.get("n_seeds", 1)), int(p.get("n_seeds", 1)))
    if seeds < 2 or not (seeds_vary(b) or seeds_vary(p)) or b["ci"][0] > p["ci"][1]:
        return f"* **CPD pays**: {figs} ({g * 100:+.0f} %)."
    return f"* **no supported verdict**: {figs} ({g * 100:+.0f} %): the 95 % intervals overlap."
