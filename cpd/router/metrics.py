"""Prometheus metrics of the router (prefix ``cpd_``), one registry per router."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class RouterMetrics:
    """All router metrics. Label values: ``cls`` ∈ {warm, cold}; ``pool`` ∈ roles;
    ``source`` ∈ {computed, L1, L2, L3}; ``tier`` ∈ {L1, L2, L3, handoff}."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft_s = Histogram("cpd_ttft_seconds", "Time to first token at the router",
                                ["cls", "pool"], buckets=_TTFT_BUCKETS, registry=r)
        self.tpot_s = Histogram("cpd_tpot_seconds", "Time per output token after the first",
                                buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2), registry=r)
        self.queue_time_s = Histogram("cpd_queue_time_seconds", "Time a request waited in a worker queue",
                                      ["pool"], buckets=_TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cpd_prompt_tokens_total", "Prompt tokens by source (computed or loaded per tier)",
                                     ["source"], registry=r)
        self.prefix_hits = Counter("cpd_prefix_hits_total", "Requests with a prefix loaded from each tier",
                                   ["tier"], registry=r)
        self.kv_bytes = Counter("cpd_kv_bytes_total", "KV bytes moved per tier and for handoff",
                                ["tier"], registry=r)
        self.requests = Counter("cpd_requests_total", "Requests by outcome", ["outcome"], registry=r)
        self.routed = Counter("cpd_routed_total", "Routing decisions by class and pool", ["cls", "pool"], registry=r)
        self.fallbacks = Counter("cpd_fallbacks_total", "Fallbacks by kind", ["kind"], registry=r)
        self.load_decisions = Counter("cpd_load_vs_recompute_total",
                                      "Policy choices to recompute a cached segment instead of loading it",
                                      ["tier"], registry=r)
        self.cost_bandwidth = Gauge("cpd_cost_model_bandwidth_bytes_per_second",
                                    "Measured (EWMA) load bandwidth per tier used by load-vs-recompute",
                                    ["tier"], registry=r)
        self.cost_prefill_rate = Gauge("cpd_cost_model_prefill_tokens_per_second",
                                       "Measured (EWMA) prefill rate used by the cost model", registry=r)
        self.in_flight = Gauge("cpd_requests_in_flight", "Requests in flight", registry=r)
        self.index_blocks = Gauge("cpd_index_blocks", "Blocks in the router's prefix index", ["tier"], registry=r)
        self.route_decisions = Counter("cpd_route_decisions", "Routing decisions by why the winner won "
                                       "(cpd.policy.routing.DecisionReason)", ["reason"], registry=r)
        self.admission_rejected = Counter("cpd_admission_rejected", "Requests refused with 429 because every "
                                          "candidate's predicted TTFT exceeded the admission bound", registry=r)
        self.predicted_ttft_rejected_s = Histogram("cpd_admission_predicted_ttft_seconds",
                                                   "Predicted TTFT of requests refused by admission",
                                                   buckets=_TTFT_BUCKETS, registry=r)
        self.raw_waits = Counter("cpd_read_after_write_waits", "Dispatches held for blocks being written "
                                 "through to L3, by outcome (visible: the blocks showed up; timeout: the "
                                 "bound passed, dispatched anyway)", ["outcome"], registry=r)
        self.raw_wait_s = Histogram("cpd_read_after_write_wait_seconds", "Time a dispatch was held for pending "
                                    "L3 blocks", buckets=_TTFT_BUCKETS, registry=r)
        self.decode_appends = Counter("cpd_decode_appends", "Decode-local appends by outcome (ok: finished or a "
                                      "stop string matched; cancelled: the client left; error: failed after "
                                      "its first token; fallback: failed before it, rerouted)", ["outcome"],
                                      registry=r)
        self.role_changes = Counter("cpd_role_changes", "Worker role changes (elastic roles or reported by the "
                                    "worker)", ["from_role", "to_role"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def watch_workers(self, workers) -> None:
        """Export ``cpd_workers{role}`` (usable workers per role) at each scrape, read from the
        router's :class:`cpd.router.workers.WorkerSet`, and count its role changes."""
        self.registry.register(WorkersCollector(workers))
        workers.on_role_change = lambda c: self.role_changes.labels(c["from_role"], c["to_role"]).inc()

    def watch_background(self, tasks) -> None:
        """Export the router's background tasks (:class:`cpd.router.background.BackgroundTasks`)
        at each scrape: ``cpd_router_background_task_up{task}`` (1: alive and within its stall
        bound), ``cpd_router_background_task_last_ok_age_seconds{task}`` (since its last completed
        iteration) and ``cpd_router_background_task_restarts_total{task}`` (in-process restarts)."""
        self.registry.register(BackgroundCollector(tasks))

    def watch_supervisor(self, status_path: str) -> None:
        """Export the deployment supervisor's status file (:mod:`cpd.supervise`) at each scrape:
        ``cpd_process_restarts_total{process,role}``, ``cpd_process_up{process,role}`` and
        ``cpd_process_liveness_restarts_total{process,role,reason}`` (restarts the liveness probe
        forced: ``engine_stuck``, ``no_answer`` (a worker, or ``process="router"``),
        ``consecutive_failed_steps``, ``background_stalled`` (the router; :mod:`cpd.router.background`),
        ... ; :mod:`cpd.liveness`)."""
        self.registry.register(SupervisorCollector(status_path))


class WorkersCollector:
    """Usable workers per role, read from the worker set at each scrape (never stale)."""

    def __init__(self, workers):
        self.workers = workers

    def collect(self):
        g = GaugeMetricFamily("cpd_workers", "Usable (healthy, accepted) workers per role", labels=["role"])
        for role, n in sorted(self.workers.role_counts().items()):
            g.add_metric([role], float(n))
        yield g


class SupervisorCollector:
    """Reads the supervisor's status file (written by the launcher, which outlives the router's
    restarts) on each scrape; the router itself keeps no restart state."""

    def __init__(self, status_path: str):
        self.status_path = status_path

    def collect(self):
        from cpd.supervise import read_status
        procs = read_status(self.status_path).get("processes", {})
        restarts = CounterMetricFamily("cpd_process_restarts", "Restarts of each deployment process by the supervisor",
                                       labels=["process", "role"])
        up = GaugeMetricFamily("cpd_process_up", "1 if the process runs and is ready, else 0",
                               labels=["process", "role"])
        liveness = CounterMetricFamily("cpd_process_liveness_restarts", "Processes the supervisor killed for a "
                                       "restart because they failed their liveness probe (by the last failure's "
                                       "reason); also counted in cpd_process_restarts_total",
                                       labels=["process", "role", "reason"])
        for name, p in sorted(procs.items()):
            restarts.add_metric([name, p.get("role", "")], float(p.get("restarts", 0)))
            up.add_metric([name, p.get("role", "")], 1.0 if p.get("alive") and p.get("ready") else 0.0)
            for reason, n in sorted((p.get("liveness_restarts") or {}).items()):
                liveness.add_metric([name, p.get("role", ""), reason], float(n))
        yield restarts
        yield up
        yield liveness


class BackgroundCollector:
    """The router's background tasks, read at each scrape (:mod:`cpd.router.background`)."""

    def __init__(self, tasks):
        self.tasks = tasks

    def collect(self):
        from cpd.router.background import background_verdict
        now = self.tasks.clock()
        snap = self.tasks.snapshot()
        failing = set(background_verdict(snap, now).failing)
        up = GaugeMetricFamily("cpd_router_background_task_up", "1 if the router's background task is alive and "
                               "completed an iteration within its stall bound, else 0", labels=["task"])
        age = GaugeMetricFamily("cpd_router_background_task_last_ok_age_seconds", "Seconds since the background "
                                "task last completed an iteration", labels=["task"])
        restarts = CounterMetricFamily("cpd_router_background_task_restarts", "In-process restarts of the "
                                       "background task after it died", labels=["task"])
        for t in sorted(snap, key=lambda t: t.name):
            up.add_metric([t.name], 0.0 if t.name in failing else 1.0)
            age.add_metric([t.name], t.silent_for_s(now))
            restarts.add_metric([t.name], float(t.restarts))
        yield up
        yield age
        yield restarts
