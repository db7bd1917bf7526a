"""Simulator validation: same policy objects, determinism, M/D/1, decode fast-forward, links, workloads."""
import json
import math
import random

import pytest

import cpd.engine.scheduler
import cpd.policy.routing
import cpd.sim.simulator as simmod
from cpd.engine.scheduler import SchedulerConfig
from cpd.policy.cost_model import RooflineCostModel
from cpd.policy.routing import RoutingConfig
from cpd.sim.cache import BlockLRU
from cpd.sim.experiment import load_experiment, run_point
from cpd.sim.simulator import ClusterSpec, InstanceSpec, Simulator
from cpd.sim.sweep import run_sweep
from cpd.sim.workload import AgentWorkload, SimRequest, agent_workload, load_mooncake, write_mooncake


def test_simulator_uses_the_live_policy_and_scheduler_objects():
    assert simmod.route is cpd.policy.routing.route
    assert simmod.schedule is cpd.engine.scheduler.schedule


def _small_exp():
    exp = load_experiment("reference_b200")
    exp.update(ramp_s=5, steady_s=40, drain_s=20, qps_per_gpu=[0.4, 0.8])
    exp["configs"] = {k: exp["configs"][k] for k in ("2P1D", "CPD-1D")}
    return exp


def test_two_runs_are_byte_identical():
    exp = _small_exp()
    a = json.dumps(run_sweep(exp, progress=False), sort_keys=True)
    b = json.dumps(run_sweep(exp, progress=False), sort_keys=True)
    c = json.dumps(run_sweep(exp, progress=False, jobs=2), sort_keys=True)
    assert a == b == c
    assert '"requests"' in a


def test_md1_waiting_time_matches_closed_form():
    cost = RooflineCostModel.build("Llama-3.1-8B", "B200", tp=1)
    sched = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=1, max_prefill_chunk_tokens=4096,
                            block_size=512)
    cl = ClusterSpec((InstanceSpec("prefill", cost, sched),), RoutingConfig(topology="pd", block_size=512),
                     cost, 512, 0, 0.0)
    n_tok = 2048
    d = cost.prefill_time_s(n_tok, 0)  # deterministic service time
    rho = 0.7
    lam = rho / d
    rng = random.Random(7)
    t, reqs, nid = 0.0, [], 0
    for _ in range(30000):
        t += rng.expovariate(lam)
        reqs.append(SimRequest(t, n_tok, 1, tuple(range(nid, nid + 4))))
        nid += 4
    sim = Simulator(cl, reqs).run()
    waits = [r[9] for r in sim.rec[2000:]]
    w_theory = rho * d / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(w_theory, rel=0.08)


def test_decode_fast_forward_matches_exact_steps():
    exp = _small_exp()
    exp["steady_s"] = 30
    a = run_point(exp, "2P1D", 0.6)
    b = run_point(exp, "2P1D", 0.6, exact_decode=True)
    assert b["events"] > a["events"]
    assert a["requests"] == b["requests"]
    for k in ("p50", "p90"):
        assert a["tpot_s"][k] == pytest.approx(b["tpot_s"][k], rel=0.03)
        assert a["ttft_s"][k] == pytest.approx(b["ttft_s"][k], rel=0.05, abs=0.01)


def test_link_shares_bandwidth():
    class S:
        def __init__(self):
            self.ev = []

        def at(self, t, fn, *a):
            self.ev.append((t, fn, a))

    from cpd.sim.links import Link
    s = S()
    link = Link(s, "x", 100.0, 0.0)
    done = []
    link.start(0.0, 100.0, lambda now, k: done.append((now, k)), "a")
    link.start(0.0, 100.0, lambda now, k: done.append((now, k)), "b")
    while s.ev:
        s.ev.sort(key=lambda e: e[0])
        t, fn, a = s.ev.pop(0)
        fn(t, *a)
    assert [round(t, 6) for t, _ in done] == [2.0, 2.0]
    assert link.bytes_total == 200.0


def test_lru_stays_prefix_closed():
    rng = random.Random(3)
    lru = BlockLRU(50)
    chains = [[i * 1000 + j for j in range(rng.randint(5, 40))] for i in range(30)]
    for _ in range(500):
        c = rng.choice(chains)
        k = rng.randint(1, len(c))
        lru.touch_insert(c[:k])
        for ch in chains:
            present = [b in lru for b in ch]
            n = lru.leading(ch)
            assert all(present[:n]) and not any(present[n:])


def test_agent_generator_writes_valid_mooncake(tmp_path):
    w = AgentWorkload(cold_fraction=0.1)
    reqs, pre = agent_workload(w, 5.0, 120.0, 10.0, seed=3)
    reqs2, _ = agent_workload(w, 5.0, 120.0, 10.0, seed=3)
    assert reqs == reqs2 and len(pre) == 150
    p = tmp_path / "agent.jsonl"
    write_mooncake(reqs, p)
    back = load_mooncake(p)
    assert len(back) == len(reqs)
    for r in back:
        assert len(r.blocks) == math.ceil(r.prompt_tokens / 512)
    warm = [r for r in reqs if r.tag == "warm"]
    assert warm and all(r.prompt_tokens > 40_000 for r in warm)


def test_trace_replay_scaling(trace_path=None):
    from tests.conftest import TRACE
    r1 = load_mooncake(TRACE, limit=200)
    r2 = load_mooncake(TRACE, limit=200, time_scale=2.0, tokens_per_hash_id=64)
    assert r2[-1].arrival_s == pytest.approx(r1[-1].arrival_s / 2)
    assert r2[5].prompt_tokens == round(r1[5].prompt_tokens / 8)
    assert r2[5].blocks == r1[5].blocks


def test_simulate_cli_writes_results_report_and_plots(tmp_path):
    import typer
    from typer.testing import CliRunner

    from cpd.sim.cli import simulate
    exp = _small_exp()
    exp["qps_per_gpu"] = [0.4]
    p = tmp_path / "exp.json"
    p.write_text(json.dumps(exp))
    app = typer.Typer()
    app.command()(simulate)
    r = CliRunner().invoke(app, [str(p), "--out", str(tmp_path / "o"), "--no-progress", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    for f in ("results.json", "report.md", "ttft_vs_qps.png", "throughput_vs_qps.png"):
        assert (tmp_path / "o" / f).stat().st_size > 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert set(res["saturation"]) == {"2P1D", "CPD-1D"}


def test_closed_loop_turn_waits_for_previous_answer():
    from cpd.sim.experiment import build_cluster, make_workload
    exp = _small_exp()
    cl = build_cluster(exp, "CPD-1D")
    reqs, pre = make_workload(exp, 1.0 * cl.num_gpus, 1)
    assert any(r.after >= 0 for r in reqs)
    sim = Simulator(cl, reqs, stop_s=80.0, prewarm=pre).run()
    checked = 0
    for i, r in enumerate(sim.reqs):
        if r.after >= 0 and sim.rec[i] is not None:
            prev = sim.rec[r.after]
            assert prev is not None and prev[8] is not None
            assert sim.rec[i][0] >= prev[8] - 1e-9
            checked += 1
    assert checked > 10


def test_gen_cli_writes_mooncake(tmp_path):
    import typer
    from typer.testing import CliRunner

    from cpd.sim.gen import generate
    app = typer.Typer()
    app.command()(generate)
    out = tmp_path / "a.jsonl"
    r = CliRunner().invoke(app, [str(out), "--qps", "2", "--duration-s", "60", "--seed", "4"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert rows and set(rows[0]) == {"timestamp", "input_length", "output_length", "hash_ids"}
