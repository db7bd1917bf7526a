"""Block hashes computed once per request: a request that brings its prompt's block hashes
(``EngineRequest.block_hashes``, the router's in one process) and a handoff continued in process
(``Engine.import_held``, which reuses the exporting engine's hashes when the namespaces agree)
give the same outputs and KV events as the engine hashing the prompt itself."""
from __future__ import annotations

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.kv.block_hash import hash_blocks

BS = 16
PROMPT = [1 + (i * 7919) % 30000 for i in range(5 * BS + 3)]


class _Clock:
    def wait(self, seconds: float) -> None:
        pass


def _engine(model_id: str = "m") -> tuple[Engine, list]:
    events: list = []
    ex = build_modeled_executor("llama-3.1-8b", "b200", 4, clock=_Clock())
    ex.model_id = model_id
    sc = SchedulerConfig(max_num_batched_tokens=32, max_prefill_chunk_tokens=32, max_num_seqs=4)
    return Engine(None, num_blocks=64, block_size=BS, executor=ex, scheduler_config=sc,
                  event_sink=events.append), events


def _drain(eng: Engine) -> list:
    outs = []
    while eng.has_unfinished():
        outs.extend((o.request_id, o.new_token_ids, o.finished, o.finish_reason) for o in eng.step())
    return outs


def _events(events: list) -> list:
    return [(type(e).__name__, e.block_hashes, e.parent_block_hash, e.token_ids) for e in events]


def test_given_block_hashes_run_as_computed_ones():
    runs = []
    for given in (False, True):
        eng, events = _engine()
        hashes = hash_blocks(PROMPT, eng.namespace) if given else None
        eng.add_request(EngineRequest("r", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), block_hashes=hashes))
        runs.append((_drain(eng), _events(events)))
    assert runs[0] == runs[1] and len(runs[0][1]) >= 1


def _handoff(in_process: bool, src_model: str) -> tuple[list, list, list]:
    src, _ = _engine(src_model)
    src.add_request(EngineRequest("r", PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), mode="prefill"))
    first = _drain(src)
    dst, events = _engine()
    if in_process:
        dst.import_held(src, "r")
    else:
        kv, toks = src.export_kv("r")
        dst.add_decode_request("r", toks, kv, SamplingParams(max_tokens=4, ignore_eos=True))
    return first, _drain(dst), _events(events)


def test_import_held_reuses_hashes_only_in_its_namespace():
    want = _handoff(False, "m")
    assert _handoff(True, "m") == want  # same namespace: the exporter's hashes, the same events
    other = _handoff(True, "other-model")  # another namespace: hashed again, under the importer's
    assert other[1:] == want[1:] and other[0] == want[0]
    assert any(e[0] == "BlockStored" for e in want[2])


def test_given_block_hashes_are_used_not_recomputed():
    eng, events = _engine()
    bogus = list(range(101, 101 + len(PROMPT) // BS))  # trusted as given (see EngineRequest)
    eng.add_request(EngineRequest("r", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True), block_hashes=bogus))
    _drain(eng)
    assert [h for e in events for h in getattr(e, "block_hashes", [])][:len(bogus)] == bogus
