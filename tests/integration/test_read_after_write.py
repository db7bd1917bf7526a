"""Read-after-write (issue 11 §5), the router's mechanism in-process: the real prefix index's
pending-write tracking, the real dispatcher's hold and the real adaptive policy. L3 visibility
arrives as real KV event batches applied to the index."""
from __future__ import annotations

import asyncio
import time

import pytest

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.kv.events import MEDIUM_L3, BlockStored, KVEventBatch
from cpd.messages.sampling import SamplingParams
from cpd.policy.routing import LinearCostModel, RoutingConfig
from cpd.router import index as index_mod
from cpd.router.dispatch import CPDBackend, _Run
from cpd.router.estimates import CostEstimates
from cpd.router.index import PENDING_GRACE_S, PrefixIndex
from cpd.router.metrics import RouterMetrics
from cpd.router.protocol import GenerationRequest
from cpd.router.workers import WorkerInfo, WorkerSet
from cpd.policy.routing import DecisionReason
from cpd.types import RoutingMode, Topology

NS = Namespace(model_id="m", weights_digest="w", tokenizer_digest="t", block_size=16)
HASHES = list(range(1000, 1010))


def _store_l3(idx: PrefixIndex, hashes: list[int], seq: int = 1) -> None:
    """The worker's L3 events for ``hashes``, one block per store value (chunk_blocks = 1)."""
    evs = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16, medium=MEDIUM_L3)
           for h in hashes]
    idx.apply_batch("p0", seq, KVEventBatch(ts=0.0, events=evs))  # type: ignore[arg-type]


def test_pending_run_continues_the_visible_l3_run():
    idx = PrefixIndex()
    _store_l3(idx, HASHES[:2])
    now = time.monotonic()
    idx.add_pending_writes(HASHES[2:6], now + 0.5)
    m = idx.match(HASHES, now_s=now)
    assert (m.l3, m.l3_pending) == (2, 6) and m.l3_pending_ready_s == pytest.approx(0.5)
    assert idx.match(HASHES, l3_max_blocks=4, now_s=now).l3_pending == 4  # capped like the L3 run
    assert idx.match(HASHES[:2] + [9999] + HASHES[3:], now_s=now).l3_pending == 0  # the run breaks at once
    _store_l3(idx, HASHES[2:4], seq=2)  # visible now: no longer pending
    m = idx.match(HASHES, now_s=now)
    assert (m.l3, m.l3_pending) == (4, 6) and idx.num_pending_writes() == 2


def test_pending_writes_expire_drop_and_stay_bounded(monkeypatch):
    idx = PrefixIndex()
    now = time.monotonic()
    idx.add_pending_writes(HASHES[:3], now)
    assert idx.match(HASHES, now_s=now + PENDING_GRACE_S / 2).l3_pending == 3
    assert idx.match(HASHES, now_s=now + PENDING_GRACE_S + 1).l3_pending == 0  # forgotten after the grace
    assert idx.num_pending_writes() == 0
    idx.add_pending_writes(HASHES[:3], now + 1)
    idx.drop_pending_writes(HASHES[:3])  # its prefill failed
    assert idx.match(HASHES, now_s=now).l3_pending == 0
    monkeypatch.setattr(index_mod, "MAX_PENDING_WRITES", 4)
    idx.add_pending_writes(HASHES, now + 1)
    assert idx.num_pending_writes() == 4  # the oldest went


def _backend(raw_wait_max_s: float) -> CPDBackend:
    workers = WorkerSet([WorkerInfo("p0", "prefill", "http://127.0.0.1:1", "tcp://127.0.0.1:2", state="accepted"),
                         WorkerInfo("d0", "decode", "http://127.0.0.1:3", "tcp://127.0.0.1:4", state="accepted")])
    cfg = RoutingConfig(topology=Topology.PD, mode=RoutingMode.ADAPTIVE, raw_wait_max_s=raw_wait_max_s)
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1024, prefill_tokens_per_s=2000.0))
    return CPDBackend(workers, PrefixIndex(), NS, cfg, est, RouterMetrics(), client=None)  # type: ignore[arg-type]


def _request(n: int) -> GenerationRequest:
    return GenerationRequest(request_id="r", prompt_token_ids=list(range(10, 10 + n)),
                             sampling=SamplingParams(max_tokens=4))


def test_dispatch_holds_until_pending_blocks_are_visible():
    """A 2000-token prompt (1 s to recompute at 2000 tok/s) whose blocks are being written through
    and predicted visible in 0.3 s waits for them; they show up after 0.1 s; the request is decided
    again and loads them from L3."""
    async def main():
        b = _backend(raw_wait_max_s=1.0)
        req = _request(2000)
        hashes = hash_blocks(req.prompt_token_ids, NS)
        b.index.add_pending_writes(hashes, time.monotonic() + 0.3)
        d0, _ = b.decide(req)
        assert d0.reason == DecisionReason.WAIT_FOR_L3 and d0.wait_for_l3_s > 0

        async def writer():
            await asyncio.sleep(0.1)
            _store_l3(b.index, hashes)
        task = asyncio.create_task(writer())
        run = _Run(req)
        d, _ = await b._decide_first(run)
        await task
        return b, d, run, len(hashes)

    b, d, run, n_blocks = asyncio.run(main())
    assert 0.05 <= run.raw_wait_s < 0.9
    assert d.wait_for_l3_s == 0 and d.load_plan.l3_blocks == min(n_blocks, 1999 // 16)
    assert b.metrics.raw_waits.labels("visible")._value.get() == 1


def test_dispatch_hold_is_bounded():
    """Blocks that never show up: the hold ends at the bound and the request is dispatched anyway
    (recomputing)."""
    async def main():
        b = _backend(raw_wait_max_s=0.2)
        req = _request(2000)
        b.index.add_pending_writes(hash_blocks(req.prompt_token_ids, NS), time.monotonic() + 0.15)
        run = _Run(req)
        t0 = time.monotonic()
        d, _ = await b._decide_first(run)
        return b, d, run, time.monotonic() - t0

    b, d, run, took = asyncio.run(main())
    assert 0.1 <= run.raw_wait_s <= took < 1.0
    assert d.wait_for_l3_s == 0 and d.load_plan.l3_blocks == 0
    assert b.metrics.raw_waits.labels("timeout")._value.get() == 1
