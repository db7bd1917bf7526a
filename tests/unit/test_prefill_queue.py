"""A worker's queued prefill estimates (cpd.policy.prefill_queue), the queued_prefill_s of the
policy's WorkerLoad, kept by the simulator (and meant for the live router): by default each
prefill counts whole until its first token (a running sum, the records' behaviour); with
``count_elapsed`` a started prefill counts its remaining estimate only (session 18, issue 11)."""
from __future__ import annotations

import pytest

from cpd.policy.prefill_queue import QueuedPrefills, remaining_s


def test_by_default_a_started_prefill_counts_whole_until_its_first_token():
    q = QueuedPrefills()
    q.add("a", 0.8)
    q.add("b", 0.2)
    q.start("a", 10.0)
    assert q.queued_s(10.7) == pytest.approx(1.0)
    q.remove("a")
    assert q.queued_s(10.7) == pytest.approx(0.2)
    q.remove("b")
    q.remove("b")  # twice: nothing
    assert q.queued_s(11.0) == 0.0 and len(q) == 0


def test_with_count_elapsed_a_started_prefill_counts_what_remains():
    """A worker 0.6 s into a 0.8 s prefill has 0.2 s ahead of a new request, not 0.8 s."""
    q = QueuedPrefills(count_elapsed=True)
    q.add("long", 0.8)
    q.add("short", 0.05)
    assert q.queued_s(10.0) == pytest.approx(0.85)
    q.start("long", 10.0)
    assert q.unstarted() == ["short"]
    assert q.queued_s(10.6) == pytest.approx(0.25)
    q.start("long", 10.5)  # a later report does not restart it
    assert q.queued_s(10.6) == pytest.approx(0.25)
    assert q.queued_s(12.0) == pytest.approx(0.05)  # an underestimate: floored at 0, never negative
    q.start("gone", 10.0)  # unknown: nothing
    assert len(q) == 2


def test_remaining_estimate():
    assert remaining_s(1.0, None, 5.0) == 1.0
    assert remaining_s(1.0, 4.5, 5.0) == pytest.approx(0.5)
    assert remaining_s(1.0, 3.0, 5.0) == 0.0
    assert remaining_s(1.0, 6.0, 5.0) == 1.0  # a start in the future: nothing elapsed


def _sim_queue_during_one_prefill(queue_remaining: bool) -> tuple[float, list[float]]:
    """The simulator's predicted queue on the one prefill worker while a cold 60 K-token prompt
    runs there (probed every 50 ms of virtual time): (its estimate, the samples)."""
    from cpd.engine.scheduler import SchedulerConfig
    from cpd.policy.cost_model import RooflineCostModel
    from cpd.policy.routing import RoutingConfig
    from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator
    from cpd.sim.workload import SimRequest

    bs, cost = 512, RooflineCostModel.build("Llama-3.1-8B", "B200", tp=1)
    sched = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=8, max_prefill_chunk_tokens=8192, block_size=bs)
    insts = (EngineInstanceSpec("prefill", cost, sched, 400, 0), EngineInstanceSpec("decode", cost, sched, 400, 0))
    cluster = EngineClusterSpec(insts, RoutingConfig(topology="pd", block_size=bs), cost, bs,
                                queue_remaining=queue_remaining)
    n = 60_000
    sim = EngineSimulator(cluster, [SimRequest(0.0, n, 2, tuple(range(n // bs + 1)))])
    samples: list[float] = []

    def probe(now: float) -> None:
        samples.append(next(w.queued_prefill_s for w in sim._loads() if w.worker_id == "prefill-0"))
        if now < 5.0:
            sim.at(now + 0.05, probe)

    sim.at(0.01, probe)
    sim.run()
    return sim.rec[0]["est_s"], [s for s in samples if s > 0]


def test_the_simulator_counts_what_remains_of_a_running_prefill_with_queue_remaining():
    est_s, samples = _sim_queue_during_one_prefill(True)
    assert est_s > 0.3 and len(samples) >= 4
    assert samples[0] == pytest.approx(est_s - 0.01, abs=0.06)  # started at once: 10 ms in
    assert all(b < a for a, b in zip(samples, samples[1:]))
    est_s, samples = _sim_queue_during_one_prefill(False)
    assert samples and all(s == pytest.approx(est_s) for s in samples)  # whole until its first token
