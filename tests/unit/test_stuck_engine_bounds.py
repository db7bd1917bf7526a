"""A stuck engine (a step that never returns) bounds every wait on its worker:

* the router's decode relay ends a stream whose heartbeats keep coming while the engine's step
  count stands still (``decode_stall_s``), or that says the engine is stuck, and keeps one whose
  engine steps (a queued request) however long it waits;
* the worker sees its own stuck step (:class:`cpd.worker.runtime.EngineRunner`): unhealthy while
  the step runs past ``max_step_s``, healthy again when it ends;
* the fault that makes the stuck step (:class:`cpd.engine.faults.FaultPlan`) blocks and targets
  one worker.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.engine.faults import FaultPlan
from cpd.engine.sampling import SamplingParams
from cpd.messages.sampling import SamplingParams as WireSampling
from cpd.messages.worker_api import DecodeLine, ErrorBody, PrefillLine, PrefillRequest, encode
from cpd.router.decode_relay import DecodeFailed, _decode_refused, _lines
from cpd.router.metrics import RouterMetrics
from cpd.router.prefill_relay import PrefillStalled, post_prefill
from cpd.router.timeouts import DispatchTimeouts
from cpd.worker.runtime import EngineRunner

T = DispatchTimeouts(decode_idle_s=1.0, decode_stall_s=0.6)


def test_decode_deadline_names_the_bound_that_ends_first():
    deadline, why = T.decode_deadline(last_line_s=10.0, last_step_s=10.0)
    assert deadline == 10.6 and "no step" in why
    deadline, why = T.decode_deadline(last_line_s=10.0, last_step_s=10.5)
    assert deadline == 11.0 and "no line" in why


def _response(lines: list[tuple[float, DecodeLine | None]]) -> httpx.Response:
    """A streamed 200 whose lines come after the given pauses (None: an old worker's empty line)."""
    async def body():
        for pause_s, line in lines:
            await asyncio.sleep(pause_s)
            yield b"\n" if line is None else encode(line) + b"\n"
    return httpx.Response(200, content=body())


async def _relay(lines) -> tuple[list, float]:
    t0, out = time.monotonic(), []
    async for c in _lines(_response(lines), T, "d9"):
        out.append(c)
        if c.finish_reason is not None:  # where the relay stops reading
            break
    return out, time.monotonic() - t0


def _beat(steps: int, stuck: bool = False) -> DecodeLine:
    return DecodeLine(num_engine_steps=steps, engine_stuck=stuck, request_state="running")


def test_heartbeats_of_an_engine_that_does_not_step_end_the_stream_within_the_stall_bound():
    beats = [(0.1, _beat(7)) for _ in range(40)]  # 4 s of live heartbeats, the step count stands still
    with pytest.raises(DecodeFailed, match="no step") as e:
        asyncio.run(_relay(beats))
    assert e.value.worker_failed


def test_a_heartbeat_saying_stuck_ends_the_stream_at_once():
    t0 = time.monotonic()
    with pytest.raises(DecodeFailed, match="stuck") as e:
        asyncio.run(_relay([(0.05, _beat(1)), (0.05, _beat(1, stuck=True)), (5.0, _beat(2))]))
    assert e.value.worker_failed and time.monotonic() - t0 < 0.5


def test_a_queued_request_waits_while_the_engine_steps_however_long():
    beats = [(0.1, _beat(i)) for i in range(20)]  # 2 s queued: over 3 stall bounds, steps advancing
    out, elapsed = asyncio.run(_relay(beats + [(0.1, DecodeLine(token_ids=[5], finish_reason="length"))]))
    assert [c.token_ids for c in out] == [[5]] and elapsed > 3 * T.decode_stall_s


def test_tokens_are_progress_too():
    lines = [(0.2, DecodeLine(token_ids=[i])) for i in range(8)] + [(0.2, DecodeLine(finish_reason="stop"))]
    out, elapsed = asyncio.run(_relay(lines))
    assert len(out) == 9 and elapsed > T.decode_stall_s


def test_the_hang_fault_blocks_for_its_time_and_targets_its_worker():
    env = {"CPD_FAULT_STEP_HANG_SEED": "3", "CPD_FAULT_STEP_HANG_S": "0.3", "CPD_FAULT_WORKER": "d1"}
    assert not FaultPlan.from_env(env, worker_id="d0").active
    plan = FaultPlan.from_env(env, worker_id="d1")
    t0 = time.monotonic()
    plan.check_step([1, 2])
    assert time.monotonic() - t0 < 0.1
    plan.check_step([1, 3])
    assert time.monotonic() - t0 >= 0.3


def _engine(model_dir: str, hang_s: float) -> Engine:
    return Engine(None, num_blocks=256, executor=build_modeled_executor("llama-3.1-8b", "b200", 1,
                                                                       served_model_dir=model_dir),
                  faults=FaultPlan(step_hang_seed=3, step_hang_s=hang_s))


def _wait(cond, timeout_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_a_worker_whose_step_runs_past_its_bound_reports_stuck_until_the_step_ends(tiny_model_dir):
    engine = _engine(tiny_model_dir, hang_s=1.5)
    runner = EngineRunner(engine, None, max_step_s=0.4)

    async def scenario():
        assert runner.health()["healthy"] and not runner.stuck()
        runner.submit(EngineRequest("ok", list(range(20, 60)), SamplingParams(max_tokens=1)))
        await asyncio.to_thread(_wait, lambda: engine.request_state("ok") is None)  # served, idle again
        assert runner.health()["healthy"]
        runner.submit(EngineRequest("hang", list(range(20, 60)), SamplingParams(max_tokens=1, seed=3)))
        stuck_after_s = await asyncio.to_thread(_wait, runner.stuck)
        h = runner.health()
        assert not h["healthy"] and h["stuck"] and h["current_step_s"] > 0.4, h
        assert engine.request_state("hang") in ("queued", "running")  # answered while the step holds its lock
        runner.abort("hang")
        await asyncio.to_thread(_wait, lambda: not runner.stuck())
        return stuck_after_s
    try:
        stuck_after_s = asyncio.run(scenario())
    finally:
        runner.close()
    assert 0.4 <= stuck_after_s < 1.5
    assert runner.health()["healthy"] and engine.pool_stats()["num_in_use"] == 0


def test_a_stream_whose_event_loop_is_gone_does_not_stop_the_engine_thread(tiny_model_dir):
    """An output for a stream whose loop has closed made ``call_soon_threadsafe`` raise in the
    engine thread, outside the step's guard: the thread died, every later request waited forever
    and the worker still called itself healthy. Now that request is aborted and the engine serves on."""
    engine = Engine(None, num_blocks=256, executor=build_modeled_executor("llama-3.1-8b", "b200", 1,
                                                                          served_model_dir=tiny_model_dir))
    runner = EngineRunner(engine, None)

    async def orphan():  # its loop closes while the engine still computes it
        runner.submit(EngineRequest("orphan", list(range(20, 60)), SamplingParams(max_tokens=40, ignore_eos=True)))

    async def served():
        s = runner.submit(EngineRequest("next", list(range(60, 100)), SamplingParams(max_tokens=2, ignore_eos=True)))
        return await asyncio.wait_for(s.queue.get(), 10.0)
    try:
        asyncio.run(orphan())
        _wait(lambda: engine.request_state("orphan") is None)  # aborted (or finished), not stuck
        assert asyncio.run(served()).request_id == "next"
        assert runner.health()["healthy"]
        _wait(lambda: engine.pool_stats()["num_in_use"] == 0)
    finally:
        runner.close()


STUCK = encode(ErrorBody("worker w: engine stuck (step running for 3.0 s, bound 2 s)", "engine_stuck"))
PREFILL = PrefillRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=WireSampling(max_tokens=2))


async def _post_prefill(answer: httpx.Response) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: answer)) as client:
        await post_prefill(client, T, "http://p0/prefill", "p0", PREFILL)


def test_a_stuck_refusal_or_a_stuck_progress_line_is_a_worker_failure_the_router_retries():
    """503 engine_stuck (and a progress line saying stuck) raise what the callers retry on another
    worker: PrefillStalled (a TimeoutError) for a prefill, DecodeFailed(worker_failed) for a decode."""
    with pytest.raises(PrefillStalled, match="engine stuck"):
        asyncio.run(_post_prefill(httpx.Response(503, content=STUCK)))
    stuck_line = encode(PrefillLine(num_engine_steps=4, engine_stuck=True, request_state="queued")) + b"\n"
    with pytest.raises(PrefillStalled, match="stuck"):
        asyncio.run(_post_prefill(httpx.Response(200, content=stuck_line)))
    with pytest.raises(DecodeFailed, match="engine stuck") as e:
        asyncio.run(_decode_refused(RouterMetrics(), "d0", httpx.Response(503, content=STUCK)))
    assert e.value.worker_failed and not e.value.handoff_lost


def test_a_silent_worker_fails_within_the_idle_bound_and_one_grace():
    from cpd.router.stream_lines import LISTEN_GRACE_S
    timeouts = DispatchTimeouts(decode_idle_s=1.0, decode_stall_s=30.0)

    async def relay():
        async for _ in _lines(_response([(0.05, _beat(1)), (30.0, _beat(2))]), timeouts, "d9"):
            pass
    t0 = time.monotonic()
    with pytest.raises(DecodeFailed, match="no line") as e:
        asyncio.run(relay())
    assert e.value.worker_failed and time.monotonic() - t0 < timeouts.decode_idle_s + LISTEN_GRACE_S + 0.5


def test_a_router_paused_past_the_idle_bound_reads_the_line_that_came_meanwhile():
    """The router's process stopped (here: its event loop blocked) while it waited for a line that the
    worker sent in time: the expired wait is the router's oversleep, not the worker's silence."""
    async def paused_relay():
        asyncio.get_running_loop().call_later(0.2, time.sleep, T.decode_idle_s + 1.5)  # the loop stops
        return await _relay([(0.05, _beat(1)), (0.3, DecodeLine(token_ids=[9], finish_reason="length"))])
    out, _ = asyncio.run(paused_relay())
    assert [c.token_ids for c in out] == [[9]]
