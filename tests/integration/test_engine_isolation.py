"""Issue 7 §2(b, c): one request never fails a batch or a worker.

Engine level: a request whose own parameters / KV make it fail inside a step is finished
with ``finish_reason="error"`` while the other requests of the same batch get exactly the
tokens they get alone; a model forward that fails because of one request fails that request only
(bisection), and only a forward that fails with a canary too counts as a failed step; the engine
keeps serving; blocks are back to baseline. Worker level: :class:`StepHealth` reports the
current state (a good step clears it), not a sticky last error.
"""
from __future__ import annotations

import time

import pytest
import torch

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.faults import FaultPlan
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.worker.runtime import EngineRunner, StepHealth

from deploy_util import random_prompt

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    eng = Engine(tiny_model_dir, num_blocks=64)
    return lambda prompt: eng.generate(prompt, GREEDY)


def _poisoned(**kw) -> SamplingParams:
    """Sampling parameters that passed validation and then went bad (a bug elsewhere):
    ``top_k`` is not an int any more, so ``torch.topk`` raises inside the step."""
    p = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3, ignore_eos=True, **kw)
    object.__setattr__(p, "top_k", "poison")
    return p


def _run(engine: Engine, max_steps: int = 200) -> tuple[dict, dict, list[list]]:
    """Step until idle; returns tokens and finish reasons per request and each step's outputs."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        outs = engine.step()
        steps.append(outs)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert not engine.has_unfinished()
    return tokens, reasons, steps


def _assert_baseline(engine: Engine) -> None:
    engine.check_invariants()
    assert engine.pool.stats()["num_in_use"] == 0


def test_poisoned_sampling_fails_only_that_request(tiny_model_dir, oracle):
    eng = Engine(tiny_model_dir, num_blocks=64)
    prompts = {f"ok{i}": random_prompt(100 + i, 40 + 7 * i) for i in range(3)}
    for rid, p in prompts.items():
        eng.add_request(EngineRequest(rid, p, GREEDY))
    eng.add_request(EngineRequest("bad", random_prompt(99, 33), _poisoned()))
    tokens, reasons, steps = _run(eng)
    first = {o.request_id: o for o in steps[0]}
    assert set(first) == {"ok0", "ok1", "ok2", "bad"}, "all four must share the failing step"
    assert first["bad"].finish_reason == "error" and first["bad"].error.startswith("sampling: TypeError")
    assert reasons == {"ok0": "length", "ok1": "length", "ok2": "length", "bad": "error"}
    for rid, p in prompts.items():
        assert tokens[rid] == oracle(p)
    assert eng.num_failed_requests == 1 and eng.num_failed_steps == 0
    _assert_baseline(eng)


def test_poisoned_request_mid_decode_batch(tiny_model_dir, oracle):
    """The poisoned request fails at its first sample while others are decoding (and one is
    a prefill-mode request held for handoff): nobody else notices."""
    eng = Engine(tiny_model_dir, num_blocks=64)
    a, b = random_prompt(1, 50), random_prompt(2, 20)
    eng.add_request(EngineRequest("a", a, GREEDY))
    eng.step()
    eng.add_request(EngineRequest("bad", random_prompt(3, 17), _poisoned()))
    eng.add_request(EngineRequest("h", b, GREEDY, mode="prefill"))
    tokens, reasons, _ = _run(eng)
    assert reasons["bad"] == "error" and reasons["h"] == "handoff"
    assert tokens["h"] == oracle(b)[:1]
    eng.release("h")
    assert tokens["a"][-(MAX_TOKENS - 1):] == oracle(a)[1:]
    _assert_baseline(eng)


def test_kv_import_that_cannot_be_read_fails_only_that_request(tiny_model_dir, oracle):
    """A handoff KV with the right shape that cannot be copied (a meta tensor) fails late, in
    the step that admits it: only that decode request ends with an error."""
    eng = Engine(tiny_model_dir, num_blocks=64)
    c = eng.config
    toks = random_prompt(4, 40)
    kv = torch.empty((c.num_hidden_layers, 2, len(toks) - 1, c.num_key_value_heads, c.head_dim), device="meta")
    good = random_prompt(5, 45)
    eng.add_request(EngineRequest("ok", good, GREEDY))
    eng.add_decode_request("imp", toks, kv, GREEDY, num_generated=1)
    tokens, reasons, _ = _run(eng)
    assert reasons == {"ok": "length", "imp": "error"}
    assert tokens["ok"] == oracle(good)
    _assert_baseline(eng)


def _bad(seed: int = 777) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True)


def test_a_forward_that_fails_with_one_request_fails_that_request_only(tiny_model_dir, oracle):
    """A model forward that raises whenever one request is in it (``step_error_seed``): that
    request fails; its neighbours of the same step (a running decode, fresh prefills) get the
    oracle's tokens; a request still waiting (max_num_seqs) is untouched; the engine is healthy
    (no failed step)."""
    eng = Engine(tiny_model_dir, num_blocks=96, faults=FaultPlan(step_error_seed=777),
                 scheduler_config=SchedulerConfig(max_num_seqs=6))
    prompts = {f"n{i}": random_prompt(20 + i, 24 + 3 * i) for i in range(5)}
    eng.add_request(EngineRequest("n0", prompts["n0"], GREEDY))
    first = eng.step() + eng.step()  # n0 prefilled and decoding when the bad request comes
    for rid in ("n1", "n2"):
        eng.add_request(EngineRequest(rid, prompts[rid], GREEDY))
    eng.add_request(EngineRequest("boom", random_prompt(8, 20), _bad()))
    for rid in ("n3", "n4"):
        eng.add_request(EngineRequest(rid, prompts[rid], GREEDY))
    waiting = random_prompt(7, 30)
    eng.add_request(EngineRequest("w", waiting, GREEDY))
    tokens, reasons, _ = _run(eng)
    tokens["n0"] = [t for o in first for t in o.new_token_ids] + tokens["n0"]
    assert reasons == {**{rid: "length" for rid in prompts}, "boom": "error", "w": "length"}
    assert {rid: tokens[rid] for rid in prompts} == {rid: oracle(p) for rid, p in prompts.items()}
    assert tokens["w"] == oracle(waiting)
    assert eng.num_failed_requests == 1 and eng.num_failed_steps == 0 and eng.last_step_error is None
    _assert_baseline(eng)


def test_two_bad_requests_in_a_wide_step_fail_alone(tiny_model_dir, oracle):
    """Bisection finds more than one culprit: two bad requests among ten in one step."""
    eng = Engine(tiny_model_dir, num_blocks=160, faults=FaultPlan(step_error_seed=778),
                 scheduler_config=SchedulerConfig(max_num_seqs=12))
    prompts = {f"g{i}": random_prompt(40 + i, 16 + i) for i in range(8)}
    for i, (rid, p) in enumerate(prompts.items()):
        eng.add_request(EngineRequest(rid, p, GREEDY))
        if i in (2, 6):
            eng.add_request(EngineRequest(f"bad{i}", random_prompt(60 + i, 18), _bad(778)))
    tokens, reasons, _ = _run(eng)
    assert reasons == {**{rid: "length" for rid in prompts}, "bad2": "error", "bad6": "error"}
    assert {rid: tokens[rid] for rid in prompts} == {rid: oracle(p) for rid, p in prompts.items()}
    assert eng.num_failed_steps == 0
    _assert_baseline(eng)


def test_the_same_bad_request_alone_again_and_again_is_never_a_failed_step(tiny_model_dir, oracle):
    """A step holding only the bad request cannot tell who is at fault; the canary forward can:
    it runs, so the request failed, not the engine (a worker would never be restarted for it)."""
    eng = Engine(tiny_model_dir, num_blocks=64, faults=FaultPlan(step_error_seed=777))
    for i in range(12):
        eng.add_request(EngineRequest(f"boom{i}", random_prompt(8, 20), _bad()))
        _, reasons, _ = _run(eng)
        assert reasons == {f"boom{i}": "error"}
        assert eng.last_step_error is None
    assert eng.num_failed_steps == 0 and eng.num_failed_requests == 12
    assert eng.probe() is None
    later = random_prompt(9, 64)
    assert eng.generate(later, GREEDY) == oracle(later)
    _assert_baseline(eng)


def test_a_broken_engine_fails_its_steps_and_its_probe(tiny_model_dir):
    """Nothing runs any more (``break_seed``): the step's requests fail, it is a failed step
    (:attr:`last_step_error`), and :meth:`probe` fails too, with no request at all."""
    eng = Engine(tiny_model_dir, num_blocks=64, faults=FaultPlan(break_seed=779),
                 scheduler_config=SchedulerConfig(max_num_seqs=4))
    assert eng.probe() is None
    eng.add_request(EngineRequest("ok", random_prompt(10, 20), GREEDY))
    eng.add_request(EngineRequest("breaker", random_prompt(11, 20), _bad(779)))
    outs = eng.step()
    assert {o.request_id: o.finish_reason for o in outs} == {"ok": "error", "breaker": "error"}
    assert eng.last_step_error is not None and eng.num_failed_steps == 1
    assert eng.probe() is not None
    eng.add_request(EngineRequest("later", random_prompt(12, 20), GREEDY))
    _, reasons, _ = _run(eng)
    assert reasons == {"later": "error"} and eng.num_failed_steps == 2
    _assert_baseline(eng)


def test_step_health_reflects_the_current_state():
    h = StepHealth(retry_after_s=5.0)  # one confirmed engine failure (the canary failed too) is enough
    assert h.healthy(0.0) and not h.probe_due(100.0)
    h.record_failure(RuntimeError("engine failed"), 1.0)
    assert not h.healthy(1.0) and not h.healthy(60.0), "no flip back to 200 by time alone"
    assert not h.probe_due(5.9) and h.probe_due(6.0), "idle: probed every retry_after_s"
    rep = h.report(4.0)
    assert rep["healthy"] is False and rep["consecutive_failed_steps"] == 1 and "engine failed" in rep["last_error"]
    h.record_failure(RuntimeError("probe failed"), 6.0)
    assert not h.healthy(6.0) and h.report(6.0)["consecutive_failed_steps"] == 2 and not h.probe_due(10.0)
    h.record_ok()
    assert h.healthy(6.1) and not h.probe_due(100.0) and h.report(6.1)["num_failed_steps"] == 2
    tolerant = StepHealth(max_consecutive_failures=2)
    tolerant.record_failure(RuntimeError("once"), 1.0)
    assert tolerant.healthy(1.0)


def _wait(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_the_runner_probes_an_idle_failed_engine_until_it_heals(tiny_model_dir, oracle):
    """A transient break (``break_s``): the request that meets it fails, the worker reports unhealthy,
    the idle runner probes its engine every ``retry_after_s`` (each failed probe counts, as the
    supervisor's restart limit needs) and reports healthy once a probe runs; no client request is
    sacrificed as the probe, and the healed engine serves the oracle's tokens."""
    eng = Engine(tiny_model_dir, num_blocks=64, faults=FaultPlan(break_seed=780, break_s=0.6))
    runner = EngineRunner(eng, None, StepHealth(retry_after_s=0.15))
    try:
        eng.add_request(EngineRequest("breaker", random_prompt(13, 20), _bad(780)))
        runner.wake()
        _wait(lambda: runner.health()["num_failed_steps"] >= 1)
        h = runner.health()
        assert not h["healthy"] and h["num_failed_requests"] == 1
        _wait(lambda: runner.health()["consecutive_failed_steps"] >= 2)  # probes fail while broken
        _wait(lambda: runner.health()["healthy"])  # a probe ran: healed
        assert runner.health()["num_failed_requests"] == 1  # nothing else was failed to find out
    finally:
        runner.close()
    later = random_prompt(14, 30)
    assert eng.generate(later, GREEDY) == oracle(later)
    _assert_baseline(eng)
