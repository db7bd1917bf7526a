"""The router's releases of stagings nobody will fetch (:mod:`cpd.router.staging_release`), over real
HTTP: a release the worker cannot take at that moment (nothing listens on its port: restarting, cut
off) is retried until it answers, within ``release_retry_s``; pending releases are bounded.

Before, one failed try dropped the release, and the staging held its arena region and KV blocks
until the worker's own reclaim (``handoff.reclaim_after_s``, 120 s by default). A stopped
(SIGSTOP) worker does not need this: its kernel accepts the connection and buffers the request,
which the worker serves when it resumes; a partition or a closed port does.
"""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI, Request

from cpd.messages.handoff import HandoffRelease
from cpd.router.metrics import RouterMetrics
from cpd.router.staging_release import StagingReleaser
from cpd.router.timeouts import DispatchTimeouts
from cpd.deploy import free_port


class _ReleaseEndpoint:
    """A real HTTP server with ``POST /handoff/release`` that records what it was sent."""

    def __init__(self, port: int):
        self.got: list[HandoffRelease] = []
        app = FastAPI()

        @app.post("/handoff/release")
        async def release(request: Request):
            self.got.append(msgspec.json.decode(await request.body(), type=HandoffRelease))
            return {"ok": True}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.server.started

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _count(metrics: RouterMetrics, kind: str) -> float:
    return metrics.fallbacks.labels(kind)._value.get()


def test_a_release_the_worker_cannot_take_now_reaches_it_when_it_listens_again():
    port = free_port()
    endpoint = _ReleaseEndpoint(port)
    metrics = RouterMetrics()
    releaser = StagingReleaser(DispatchTimeouts(release_s=0.5, release_retry_s=30.0), metrics)

    async def scenario() -> float:
        async with httpx.AsyncClient() as client:
            releaser.release(client, f"http://127.0.0.1:{port}/handoff/release", HandoffRelease("req-7", 3))
            await asyncio.sleep(1.2)  # nothing listens: the first tries fail (connection refused)
            assert endpoint.got == [] and releaser.num_pending == 1
            await asyncio.to_thread(endpoint.start)  # the worker is reachable again
            t0 = time.monotonic()
            while releaser.num_pending:
                await asyncio.sleep(0.05)
            return time.monotonic() - t0
    try:
        delivered_after_s = asyncio.run(scenario())
    finally:
        endpoint.stop()
    assert endpoint.got == [HandoffRelease("req-7", 3)]  # delivered once, as sent
    assert delivered_after_s < 5.0  # the next try after it listens (backoff at most 8 s apart; here ~1-2 s)
    assert _count(metrics, "release_retry") >= 2 and _count(metrics, "release_unanswered") == 0


def test_a_release_nobody_answers_ends_within_its_bound_and_pending_releases_are_bounded():
    metrics = RouterMetrics()
    releaser = StagingReleaser(DispatchTimeouts(release_s=0.5, release_retry_s=1.5), metrics, max_pending=2)
    url = f"http://127.0.0.1:{free_port()}/handoff/release"  # never listens

    async def scenario() -> float:
        async with httpx.AsyncClient() as client:
            t0 = time.monotonic()
            for i in range(3):
                releaser.release(client, url, HandoffRelease(f"r{i}", 1))
            assert releaser.num_pending == 2  # the third is not retried: the sender's reclaim frees it
            while releaser.num_pending:
                await asyncio.sleep(0.05)
            return time.monotonic() - t0
    ended_after_s = asyncio.run(scenario())
    assert ended_after_s < 4.0  # release_retry_s (1.5 s) and the last try's bound
    assert _count(metrics, "release_dropped") == 1 and _count(metrics, "release_unanswered") == 2


def test_stopping_the_router_cancels_pending_releases():
    releaser = StagingReleaser(DispatchTimeouts(release_s=0.5, release_retry_s=60.0), RouterMetrics())

    async def scenario() -> int:
        async with httpx.AsyncClient() as client:
            releaser.release(client, f"http://127.0.0.1:{free_port()}/handoff/release", HandoffRelease("r", 1))
            await asyncio.sleep(0.2)
            await releaser.aclose()
            return releaser.num_pending
    assert asyncio.run(scenario()) == 0
