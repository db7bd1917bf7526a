"""A worker's L3 observations are dated so that they never undo what the router learned after
them (issue 7 §6), whatever the delay of the prefill answer that carries them.

The race, as CI met it: a cold prefill probes the store (nothing there), computes, answers, and
writes its blocks through; the ``BlockStored(L3)`` announcement can reach the router before the
answer does. The answer's observation (``present=[]``) is older than the announcement and must
not remove it. The router side runs the real dispatcher, prefix index and httpx client against a
transport that plays the worker's answer late (the only way to make that ordering certain); the
worker side runs a real connector over a real file store.
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import numpy as np

from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.kv.events import MEDIUM_L3, BlockStored, KVEventBatch
from cpd.messages.sampling import SamplingParams
from cpd.messages.worker_api import L3Observation, PrefillLine, PrefillResponse, encode
from cpd.policy.routing import LinearCostModel, RoutingConfig
from cpd.router.dispatch import CPDBackend, _Run
from cpd.router.estimates import CostEstimates
from cpd.router.index import PrefixIndex
from cpd.router.metrics import RouterMetrics
from cpd.router.protocol import GenerationRequest
from cpd.router.workers import WorkerInfo, WorkerSet
from cpd.store import open_store
from cpd.store.connector import L3Connector
from cpd.types import RoutingMode, Topology
from cpd.worker.server import _drain_l3_observations

NS = Namespace(model_id="m", weights_digest="w", tokenizer_digest="t", block_size=16)
CHUNK = 4


def _backend(transport: httpx.MockTransport) -> CPDBackend:
    workers = WorkerSet([WorkerInfo("p0", "prefill", "http://p0", "tcp://127.0.0.1:2", state="accepted"),
                         WorkerInfo("d0", "decode", "http://d0", "tcp://127.0.0.1:4", state="accepted")])
    cfg = RoutingConfig(topology=Topology.PD, mode=RoutingMode.STATIC)
    est = CostEstimates(LinearCostModel(kv_bytes_per_token=1024, prefill_tokens_per_s=2000.0))
    return CPDBackend(workers, PrefixIndex(l3_chunk_blocks=CHUNK), NS, cfg, est, RouterMetrics(),
                      client=httpx.AsyncClient(transport=transport))


def _announce(idx: PrefixIndex, hashes: list[int], seq: int) -> None:
    """The writer's ``BlockStored(L3)``, one event per chunk, as its event batch applies it."""
    evs = [BlockStored(block_hashes=hashes[i:i + CHUNK], parent_block_hash=None, token_ids=[], block_size=16,
                       medium=MEDIUM_L3) for i in range(0, len(hashes), CHUNK)]
    idx.apply_batch("p0", seq, KVEventBatch(ts=0.0, events=evs))  # type: ignore[arg-type]


def _prefill(answer_delay_s: float, observation: L3Observation, announce_after_s: float) -> PrefixIndex:
    """One ``_prefill`` through the real dispatcher; the "worker" announces the prompt's chunks
    ``announce_after_s`` after receiving the request and answers ``answer_delay_s`` after it,
    reporting ``observation``. Returns the router's index afterwards."""
    req = GenerationRequest(request_id="r", prompt_token_ids=list(range(10, 10 + 8 * 16)),
                            sampling=SamplingParams(max_tokens=2))
    hashes = hash_blocks(req.prompt_token_ids, NS)
    box: dict = {}

    async def worker(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(announce_after_s)
        _announce(box["b"].index, hashes, seq=0)
        await asyncio.sleep(answer_delay_s - announce_after_s)
        ans = PrefillResponse(first_token_ids=[1], finish_reason="length", prefill_s=0.01,
                              l3_observations=[observation])
        return httpx.Response(200, content=encode(PrefillLine(answer=ans)) + b"\n",  # the streamed answer line
                              headers={"content-type": "application/x-ndjson"})

    async def main() -> None:
        b = box["b"] = _backend(httpx.MockTransport(worker))
        d, _ = b.decide(req)
        await b._prefill(_Run(req), d, hashes)
    asyncio.run(main())
    return box["b"].index


def _obs(hashes: list[int], offset_s: float, gone: bool = False) -> L3Observation:
    chunks = [(hashes[i + CHUNK - 1], CHUNK) for i in range(0, len(hashes), CHUNK)]
    return L3Observation(block_hashes=hashes, present=[], gone=chunks if gone else [], offset_s=offset_s)


def test_a_late_answer_does_not_undo_an_announcement_made_after_its_probe():
    hashes = hash_blocks(list(range(10, 10 + 8 * 16)), NS)
    # probed at receipt (nothing there), chunks announced 50 ms later, answer 400 ms late
    idx = _prefill(answer_delay_s=0.4, observation=_obs(hashes, offset_s=0.0), announce_after_s=0.05)
    assert idx.sizes()["L3"] == 8
    # a probe from an earlier request, drained into this answer, is older still
    idx = _prefill(answer_delay_s=0.4, observation=_obs(hashes, offset_s=-1.0), announce_after_s=0.05)
    assert idx.sizes()["L3"] == 8


def test_a_check_made_after_the_announcement_still_corrects_the_view():
    """The converse: a read 200 ms after receipt found the chunks gone (evicted or corrupt since
    their announcement at 50 ms): they leave the view."""
    hashes = hash_blocks(list(range(10, 10 + 8 * 16)), NS)
    idx = _prefill(answer_delay_s=0.4, observation=_obs(hashes, offset_s=0.2, gone=True), announce_after_s=0.05)
    assert idx.sizes()["L3"] == 0


def test_worker_dates_each_observation_from_the_requests_receipt(tmp_path):
    store = open_store(f"file://{tmp_path / 'kv'}", chunk_blocks=CHUNK)
    c = L3Connector(store, write_async=False)
    hs = hash_blocks(list(range(10, 10 + 8 * 16)), NS)
    blocks = [np.zeros((2, 16, 4), dtype=np.float32) for _ in hs]
    c.save(hs, None, [], blocks)
    before = time.monotonic()
    c.lookup(hs)  # a probe made for an earlier request
    received_s = time.monotonic() + 0.5  # this request arrives 0.5 s later
    got = _drain_l3_observations(SimpleNamespace(connector=c), received_s)  # type: ignore[arg-type]
    c.close()
    assert len(got) == 1 and len(got[0].present) == 2
    assert before - received_s <= got[0].offset_s <= -0.5
