"""Adversarial trials of the adaptive mechanism in-process (issue 11 §3-§5): the router's real
``WorkerSet`` poller, ``ElasticRoles`` loop, decode relay and dispatcher, against the real worker
HTTP app (``cpd.worker.server.build_app``, its ``POST /role``) or small real HTTP servers
(uvicorn on a free port) that misbehave on purpose: a ``/load`` answer that predates a role change,
an append stream that sends heartbeats but never a token, a pending L3 write re-announced by a
second writer during a read-after-write hold, and a scripted load whose cold/warm mix flips.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.deploy import free_port
from cpd.messages.sampling import SamplingParams
from cpd.messages.worker_api import AppendRequest, LoadReport, encode
from cpd.policy.role_window import RoleWindow
from cpd.policy.roles import PlannerConfig
from cpd.policy.routing import DecisionReason, LinearCostModel, LoadPlan, RouteDecision, RoutingConfig
from cpd.router.compat import Requirements, refusal_reason, reported_role_swap
from cpd.router.decode_relay import DecodeFailed, relay_decode
from cpd.router.dispatch import CPDBackend, _Run
from cpd.router.elastic import ElasticRoles, apply_role_change
from cpd.router.estimates import CostEstimates
from cpd.router.index import PrefixIndex
from cpd.router.metrics import RouterMetrics
from cpd.router.protocol import GenerationRequest
from cpd.router.timeouts import DispatchTimeouts
from cpd.router.workers import WorkerInfo, WorkerSet
from cpd.types import RequestClass, Role, RoutingMode, Topology
from cpd.worker.server import WorkerState, build_app


class _Server:
    """A real HTTP server (uvicorn, one thread, a free port) for one app."""

    def __init__(self, app: FastAPI):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "_Server":
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _worker(wid: str, role: str, url: str = "") -> WorkerInfo:
    return WorkerInfo(wid, role, url or f"http://{wid}", f"tcp://{wid}:1", state="accepted")


def test_a_load_answer_older_than_a_role_change_never_reverts_it():
    """The router changes a worker's role while a ``/load`` poll is in flight whose answer was made
    before the change: the poller must not adopt that stale role back (a spurious change pair)."""
    role = {"now": Role.PREFILL}
    app = FastAPI()

    @app.get("/load")
    async def load():
        seen = role["now"]  # the role as of the request's arrival
        await asyncio.sleep(0.4)
        return Response(encode(LoadReport(role=seen, worker_id="p0", boot_id="b")), media_type="application/json")

    async def main(url: str) -> WorkerSet:
        ws = WorkerSet([_worker("p0", "prefill", url)])
        async with httpx.AsyncClient() as client:
            poll = asyncio.create_task(ws.poll_once(client))
            await asyncio.sleep(0.15)
            role["now"] = Role.PRE_PREFILL  # POST /role on the worker, then the router's view
            ws.set_role("p0", Role.PRE_PREFILL, "planner: test")
            await poll
            await ws.poll_once(client)  # a fresh poll agrees with the change
        return ws

    with _Server(app) as srv:
        ws = asyncio.run(main(srv.url))
    w = ws.by_id["p0"]
    assert w.role == "pre-prefill" and w.role_epoch == 1, w.last_role_change
    assert w.last_role_change is not None and w.last_role_change["reason"] == "planner: test"


def test_append_first_token_is_bounded_although_heartbeats_keep_coming():
    """An append stream that answers at once and then sends only heartbeats (a decode worker that
    never gets to the request) fails at the first-token bound, not never; its worker, whose
    heartbeats still come, is not blamed (the caller reroutes: the estimate was short)."""
    app = FastAPI()

    @app.post("/append")
    async def append():
        async def beats():
            for _ in range(200):
                yield b"\n"
                await asyncio.sleep(0.1)
        return StreamingResponse(beats(), media_type="application/x-ndjson")

    timeouts = DispatchTimeouts(decode_floor_s=5.0, decode_idle_s=5.0)
    body = AppendRequest(request_id="a1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2))

    async def main(url: str) -> float:
        w = _worker("d0", "decode", url)
        async with httpx.AsyncClient() as client:
            t0 = time.monotonic()
            with pytest.raises(DecodeFailed) as e:
                async for _ in relay_decode(client, timeouts, RouterMetrics(), w, asyncio.Semaphore(1), body,
                                            t0 + 1.0, 0, path="/append", first_token_deadline=t0 + 1.0):
                    pass
            assert not e.value.worker_failed
            assert w.running_requests == 0
            return time.monotonic() - t0

    with _Server(app) as srv:
        took = asyncio.run(main(srv.url))
    assert 0.9 <= took < 3.0, took


NS = Namespace(model_id="m", weights_digest="w", tokenizer_digest="t", block_size=16)


def test_read_after_write_decides_again_on_visible_blocks_only():
    """During a hold, a second writer (e.g. the first one's retry) re-announces the same blocks with
    a later predicted time. The hold still ends at its bound and the request is decided again on
    what is visible: no second hold, and no load plan counting blocks that are still pending."""
    workers = WorkerSet([_worker("p0", "prefill", "http://127.0.0.1:1"), _worker("d0", "decode", "http://127.0.0.1:3")])
    cfg = RoutingConfig(topology=Topology.PD, mode=RoutingMode.ADAPTIVE, raw_wait_max_s=2.0)
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1024, prefill_tokens_per_s=2000.0))
    b = CPDBackend(workers, PrefixIndex(), NS, cfg, est, RouterMetrics(), client=None)  # type: ignore[arg-type]
    req = GenerationRequest(request_id="r", prompt_token_ids=list(range(10, 2010)), sampling=SamplingParams(max_tokens=4))
    hashes = hash_blocks(req.prompt_token_ids, NS)

    async def main():
        b.index.add_pending_writes(hashes, time.monotonic() + 0.2)

        async def second_writer():
            await asyncio.sleep(0.1)
            b.index.add_pending_writes(hashes, time.monotonic() + 0.8)
        task = asyncio.create_task(second_writer())
        run = _Run(req)
        d, _ = await b._decide_first(run)
        await task
        return d, run

    d, run = asyncio.run(main())
    assert 0.15 <= run.raw_wait_s < 0.6
    assert d.reason != DecisionReason.WAIT_FOR_L3 and d.wait_for_l3_s == 0
    assert d.load_plan.l3_blocks == 0  # none of them is visible
    assert b.index.num_pending_writes() == len(hashes)
    # a retry (another prefill attempt) is dispatched at once: never planned on pending blocks
    b.index.add_pending_writes(hashes, time.monotonic() + 0.5)
    assert b.decide(req)[0].reason == DecisionReason.WAIT_FOR_L3
    retry, _ = b.decide(req, allow_append=False, allow_raw=False)
    assert retry.reason != DecisionReason.WAIT_FOR_L3 and retry.load_plan.l3_blocks == 0


def test_a_prefill_side_role_swap_is_adopted_not_refused():
    """A worker reporting the other prefill-side role than the router's config (a run-time change
    the restarted side did not see) is compatible; decode vs prefill still is not."""
    req = Requirements(NS, 2048)
    info = {"role": "pre-prefill", "namespace": {k: getattr(NS, k) for k in NS.__dataclass_fields__},
            "max_model_len": 2048}
    assert refusal_reason(info, "prefill", req) is None
    assert reported_role_swap(info, "prefill") == "pre-prefill"
    assert reported_role_swap(info, "pre-prefill") is None
    assert "role" in (refusal_reason(info, "decode", req) or "")
    assert "role" in (refusal_reason({**info, "role": "decode"}, "prefill", req) or "")
    assert reported_role_swap({**info, "role": "decode"}, "prefill") is None


def _decision(cold: bool) -> RouteDecision:
    return RouteDecision(RequestClass.COLD if cold else RequestClass.WARM, Role.PRE_PREFILL if cold else Role.PREFILL,
                         "w", "d0", LoadPlan(), 0.0, 0.1)


def test_elastic_roles_follow_a_flipping_load_without_oscillating(caplog):
    """The router's planner loop (real ``ElasticRoles``, ``RoleWindow``, ``WorkerSet``, metrics)
    over a scripted load whose cold/warm mix flips every 60 s (virtual time), applying its changes
    through the real worker app's ``POST /role``. Each phase moves workers only towards its busy
    pool, at most two, and settles (nothing moves in a phase's last 30 s); every change is applied
    at the worker, recorded, logged and counted once."""
    ids = {"pp0": Role.PRE_PREFILL, "pp1": Role.PRE_PREFILL, "p0": Role.PREFILL, "p1": Role.PREFILL}
    states = {wid: WorkerState(role, wid, None, None, None, None, None) for wid, role in ids.items()}
    mounts = {f"http://{wid}": httpx.ASGITransport(app=build_app(st)) for wid, st in states.items()}
    ws = WorkerSet([_worker(wid, str(role)) for wid, role in ids.items()])
    metrics = RouterMetrics()
    metrics.watch_workers(ws)
    window = RoleWindow(window_s=10.0, ttft_slo_s=1.0)
    loop = ElasticRoles(ws, window, PlannerConfig(interval_s=1.0, min_dwell_s=10.0, hysteresis=0.2), metrics)
    phases = [True, False, True, False]  # cold-heavy, warm-heavy, ...
    applied: list[tuple[int, float, str, str]] = []

    async def main():
        async with httpx.AsyncClient(mounts=mounts) as client:
            for p, cold_heavy in enumerate(phases):
                for s in range(60):
                    now = 60.0 * p + s
                    for _ in range(6):  # 3 s of cold (or warm) work per second, 0.5 s of the other
                        window.observe_dispatch(now, _decision(cold_heavy), 0.5)
                    window.observe_dispatch(now, _decision(not cold_heavy), 0.5)
                    for role in (Role.PRE_PREFILL, Role.PREFILL):
                        window.observe_prefill_done(now, role, 0.1, 0.5)
                    for c in await loop.plan_once(client, now_s=now):
                        applied.append((p, now, c.worker_id, str(c.to_role)))

    with caplog.at_level(logging.WARNING, logger="cpd.router"):
        asyncio.run(main())
    print("changes:", applied)
    for p, cold_heavy in enumerate(phases):
        mine = [a for a in applied if a[0] == p]
        busy = "pre-prefill" if cold_heavy else "prefill"
        assert 1 <= len(mine) <= 2 and all(to == busy for *_, to in mine), mine
        assert all(now < 60 * p + 30 for _, now, _, _ in mine), mine
        moved = [wid for _, _, wid, _ in mine]
        assert len(set(moved)) == len(moved)  # nobody moves twice in a phase (min dwell, no flapping)
    for wid, st in states.items():  # worker and router agree on every role
        assert str(st.role) == ws.by_id[wid].role
    counted = sum(s.value for m in metrics.role_changes.collect() for s in m.samples if s.name.endswith("_total"))
    assert counted == len(applied)
    logged = [r for r in caplog.records if r.name == "cpd.router" and " role " in r.getMessage()]
    assert len(logged) == len(applied)


def test_a_forced_role_change_starts_the_workers_dwell_too():
    """An operator moves ``p1`` to pre-prefill (``POST /cpd/role``'s path) under a warm-heavy load:
    the planner, which would move one pre-prefill worker back to prefill, never picks ``p1`` before
    its minimum dwell has passed (it would otherwise: ``p1`` sorts first among idle workers)."""
    ids = {"pp0": Role.PRE_PREFILL, "p0": Role.PREFILL, "p1": Role.PREFILL}
    states = {wid: WorkerState(role, wid, None, None, None, None, None) for wid, role in ids.items()}
    mounts = {f"http://{wid}": httpx.ASGITransport(app=build_app(st)) for wid, st in states.items()}
    ws = WorkerSet([_worker(wid, str(role)) for wid, role in ids.items()])
    window = RoleWindow(window_s=10.0, ttft_slo_s=1.0)
    loop = ElasticRoles(ws, window, PlannerConfig(interval_s=1.0, min_dwell_s=20.0, hysteresis=0.2), RouterMetrics())
    moved: list[tuple[float, str]] = []

    async def main():
        async with httpx.AsyncClient(mounts=mounts) as client:
            ok, _ = await apply_role_change(client, ws, "p1", "pre-prefill", "forced via POST /cpd/role")
            assert ok and states["p1"].role == Role.PRE_PREFILL
            for s in range(30):
                now = 100.0 + s
                for _ in range(6):
                    window.observe_dispatch(now, _decision(False), 0.5)
                for role in (Role.PRE_PREFILL, Role.PREFILL):
                    window.observe_prefill_done(now, role, 0.1, 0.5)
                moved.extend((now, c.worker_id) for c in await loop.plan_once(client, now_s=now))

    asyncio.run(main())
    assert moved, "the planner should move a pre-prefill worker to the busy prefill pool"
    assert all(wid != "p1" or now >= 100.0 + 20.0 for now, wid in moved), moved
    assert moved[0][1] == "pp0", moved


def test_a_lost_cancellation_after_a_disconnect_is_repeated():
    """A client disconnect cancels the request's task; code that swallows that cancellation once
    (``asyncio.wait_for`` before Python 3.12 does when the cancellation races with its result)
    is cancelled again, so the block still ends soon after the client left."""
    from cpd.router.openai_front.cancel import RECANCEL_S, CancelOnDisconnect, ClientGone

    async def main() -> tuple[float, int]:
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        swallowed = 0
        t0 = time.monotonic()
        with pytest.raises(ClientGone):
            async with CancelOnDisconnect(receive):
                asyncio.get_running_loop().call_later(0.1, gone.set)
                while time.monotonic() - t0 < 10:
                    try:
                        await asyncio.sleep(0.05)
                    except asyncio.CancelledError:
                        if swallowed:
                            raise
                        swallowed += 1  # lost once, as wait_for's race loses it
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return time.monotonic() - t0, swallowed

    took, swallowed = asyncio.run(main())
    assert swallowed == 1 and took < 0.1 + RECANCEL_S + 1.0, took
