"""A worker the router must recheck (it came back after being unhealthy, or its ``/load`` shows a
new boot id: another process at the same address) is not routed to while its ``GET /info`` is in
flight. Before, the poller marked it healthy and left its old ``accepted`` verdict (and old boot
id) in place until the check returned: a request routed in that window went out with the old
boot id and came back 409 ``worker_restarted`` (a retry elsewhere), and ``GET /health`` reported
the worker usable before the router had checked it (CI failed on that: a test's fresh cold prompt
after ``Deployment.wait_ready`` went to the prefill worker instead of the restarted pre-prefill
worker).

The check's timing is the fault here (a ``/info`` answer held until the test has looked), so the
worker's HTTP side is an ``httpx.MockTransport``; the poller, the compatibility check and the
verdict are the router's own."""
from __future__ import annotations

import asyncio
import dataclasses

import httpx

from cpd.kv.block_hash import Namespace
from cpd.messages.worker_api import LoadReport, WorkerInfoReport, encode
from cpd.router import compat
from cpd.router.workers import WorkerInfo, WorkerSet

NS = Namespace(model_id="m", weights_digest="w", tokenizer_digest="t")


def _info(boot_id: str) -> bytes:
    return encode(WorkerInfoReport(worker_id="pp0", role="pre-prefill", boot_id=boot_id,
                                   namespace=dataclasses.asdict(NS), max_model_len=1024, kv_bytes_per_token=64))


def _run(was_healthy: bool, old_boot: str, new_boot: str) -> list[tuple[bool, bool]]:
    """Poll once while ``/info`` is held; returns (usable, snapshot healthy) seen during the check
    and after it."""
    seen: list[tuple[bool, bool]] = []
    w = WorkerInfo("pp0", "pre-prefill", "http://pp0", "tcp://pp0", state="accepted", boot_id=old_boot,
                   healthy=was_healthy)
    ws = WorkerSet([w])
    req = compat.Requirements(NS, 1024)
    clients: list[httpx.AsyncClient] = []

    async def admit(x: WorkerInfo) -> bool:
        return await compat.admit(clients[0], x, req)

    ws.admit, ws.needs_check = admit, compat.needs_check

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":
            return httpx.Response(200, content=encode(LoadReport(role="pre-prefill", worker_id="pp0",
                                                                 boot_id=new_boot)))
        seen.append((w.usable, w.snapshot().healthy))  # the router's view while the check runs
        await asyncio.sleep(0)
        return httpx.Response(200, content=_info(new_boot))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            clients.append(c)
            await ws.poll_once(c)
        seen.append((w.usable, w.snapshot().healthy))

    asyncio.run(main())
    assert w.boot_id == new_boot
    return seen


def test_a_restarted_worker_is_not_routable_until_its_check_returns():
    assert _run(was_healthy=True, old_boot="b1", new_boot="b2") == [(False, False), (True, True)]


def test_a_worker_back_from_unhealthy_is_not_routable_until_its_check_returns():
    assert _run(was_healthy=False, old_boot="b1", new_boot="b1") == [(False, False), (True, True)]


def test_an_unchanged_healthy_worker_is_not_rechecked():
    seen = _run(was_healthy=True, old_boot="b1", new_boot="b1")
    assert seen == [(True, True)]  # no GET /info at all
