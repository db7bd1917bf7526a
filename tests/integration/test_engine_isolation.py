"""Issue 7 §2(b, c): one request never fails a batch or a worker.

Engine level: a request whose own parameters / KV make it fail inside a step is finished
with ``finish_reason="error"`` while the other requests of the same batch get exactly the
tokens they get alone; a failed model forward fails that step's requests only and the engine
keeps serving; blocks are back to baseline. Worker level: :class:`StepHealth` reports the
current state (a good step clears it), not a sticky last error.
"""
from __future__ import annotations

import pytest
import torch

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.faults import FaultPlan
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.worker.runtime import StepHealth

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


def test_failed_forward_fails_its_step_only_and_engine_keeps_serving(tiny_model_dir, oracle):
    """A model forward that raises fails the requests of that step; a request still waiting
    (max_num_seqs=2) is untouched, and later requests get the oracle tokens."""
    eng = Engine(tiny_model_dir, num_blocks=64, faults=FaultPlan(step_error_seed=777),
                 scheduler_config=SchedulerConfig(max_num_seqs=2))
    waiting = random_prompt(7, 30)
    eng.add_request(EngineRequest("x", random_prompt(6, 30), GREEDY))
    eng.add_request(EngineRequest("boom", random_prompt(8, 20),
                                  SamplingParams(max_tokens=MAX_TOKENS, seed=777, ignore_eos=True)))
    eng.add_request(EngineRequest("w", waiting, GREEDY))
    outs = eng.step()
    assert {o.request_id: o.finish_reason for o in outs} == {"x": "error", "boom": "error"}
    assert eng.last_step_error is not None and eng.num_failed_steps == 1
    tokens, reasons, _ = _run(eng)
    assert reasons == {"w": "length"} and tokens["w"] == oracle(waiting)
    assert eng.last_step_error is None
    later = random_prompt(9, 64)
    assert eng.generate(later, GREEDY) == oracle(later)
    _assert_baseline(eng)


def test_step_health_reflects_the_current_state():
    h = StepHealth(max_consecutive_failures=2, retry_after_s=5.0)
    assert h.healthy(0.0)
    h.record_failure(RuntimeError("one bad step"), 1.0)
    assert h.healthy(1.0), "one failed step fails its requests, not the worker"
    h.record_ok()
    h.record_failure(RuntimeError("again"), 2.0)
    assert h.healthy(2.0), "a good step in between resets the count"
    h.record_failure(RuntimeError("and again"), 3.0)
    assert not h.healthy(3.0) and not h.healthy(7.9)
    rep = h.report(4.0)
    assert rep["healthy"] is False and rep["consecutive_failed_steps"] == 2 and "again" in rep["last_error"]
    assert h.healthy(8.0), "idle after failures: healthy again after retry_after_s, so it gets probed"
    h.record_failure(RuntimeError("probe failed"), 8.5)
    assert not h.healthy(8.5)
    h.record_ok()
    assert h.healthy(8.6) and h.report(8.6)["num_failed_steps"] == 4
