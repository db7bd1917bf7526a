"""Live deployments of modeled workers (real router, worker processes, HTTP, L3 file store,
handoff, KV events): the modeled oracle (same request sequence → same pseudo tokens and the
same block accounting), pools back to baseline, no torch in a worker, and 12 workers + router
on this machine with the RSS of each worker printed."""
from __future__ import annotations

from pathlib import Path

import pytest

from cpd.config import build_config
from cpd.deploy import Deployment
from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from deploy_util import assert_no_leaks, complete

MODELED = {"engine.executor": "modeled", "engine.hardware": "b200", "engine.model_shape": "llama-3.1-8b",
           "engine.tp": 4, "engine.time_dilation": 2.0, "engine.num_blocks": 4096, "kv.host_kv_bytes": 64 << 30,
           "handoff.arena_bytes": 16 << 20}  # modeled KV payloads are tiny


def _modeled(model_dir: str, **overrides) -> Deployment:
    """Static routing: the same request sequence then takes the same path on every run (adaptive
    routing follows measured times, so its worker choice, and the per-worker block accounting
    this test compares across runs, may differ)."""
    o = {**MODELED, "model.dir": model_dir, "router.port": 0, "deployment.supervise": False,
         "router.routing_mode": "static", **overrides}
    return Deployment(build_config(overrides=o))  # started by `with`


def _proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


def _rss_mib(pid: int) -> float:
    return int(_proc_status(pid)["VmRSS"].split()[0]) / 1024


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _sequence() -> list[list[int]]:
    """A small agent-like sequence: a shared system prefix, growing conversations, one cold prompt."""
    system = [100 + (i * 31) % 200 for i in range(96)]
    convo = system + [300 + i % 50 for i in range(40)]
    return [system + [7, 8, 9], convo, convo + [11] * 50, [500 + i % 100 for i in range(150)], convo + [12] * 70]


def _oracle(model_dir: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    eng = Engine(None, num_blocks=4096, executor=build_modeled_executor("llama-3.1-8b", "b200", 4,
                                                                        served_model_dir=model_dir))
    return [eng.generate(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]


def _run(dep: Deployment, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict]:
    tokens = [complete(dep, p, max_tokens=max_tokens)["choices"][0]["token_ids"] for p in prompts]
    assert_no_leaks(dep)
    stats = dep.pool_stats()
    accounting = {w: {k: s[k] for k in ("num_cached", "num_in_use", "l2_num_used")} for w, s in stats.items()}
    return tokens, accounting


def test_modeled_deployment_keeps_the_contracts(tiny_model_dir):
    prompts = _sequence()
    want = _oracle(tiny_model_dir, prompts, 6)
    runs = []
    for _ in range(2):
        with _modeled(tiny_model_dir) as dep:
            for w in dep.alive_workers():
                assert not _maps_torch(w["pid"]), f"{w['worker_id']} loaded libtorch"
            runs.append(_run(dep, prompts, 6))
    assert runs[0][0] == want  # the modeled oracle: the path (pre-prefill, prefill, L3, handoff) changes nothing
    assert runs[0] == runs[1]  # same request sequence: same tokens, same block accounting per worker


@pytest.mark.slow
def test_twelve_modeled_workers_and_router_fit_here(tiny_model_dir):
    with _modeled(tiny_model_dir, **{"deployment.num_pre_prefill": 4, "deployment.num_prefill": 4,
                                     "deployment.num_decode": 4}) as dep:
        assert len(dep.alive_workers()) == 12
        prompts = [[1000 + 17 * j + i for i in range(200)] for j in range(12)]
        got = [complete(dep, p, max_tokens=4)["choices"][0]["token_ids"] for p in prompts]
        assert got == _oracle(tiny_model_dir, prompts, 4)
        assert_no_leaks(dep)
        rss = {w["worker_id"]: _rss_mib(w["pid"]) for w in dep.alive_workers()}
        print("RSS MiB per modeled worker:", {k: round(v) for k, v in sorted(rss.items())})
        print(f"RSS MiB: max {max(rss.values()):.0f}, total {sum(rss.values()):.0f} over {len(rss)} workers")
        assert max(rss.values()) < 200  # measured 71-89 MiB; 12 workers + router fit in this machine's 24 GiB
