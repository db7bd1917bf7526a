"""A prompt handed to the engine as a 1-D numpy integer array (the simulator's path: one C
conversion instead of a check per id) is the same request as the list of its ids: same
tokens, same block hashes and events, same outputs; and it is refused by the same rules."""
from __future__ import annotations

import numpy as np
import pytest

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig

BS = 16


class _Clock:
    def wait(self, seconds: float) -> None:
        pass


def _engine() -> tuple[Engine, list]:
    events: list = []
    ex = build_modeled_executor("llama-3.1-8b", "b200", 4, clock=_Clock())
    sc = SchedulerConfig(max_num_batched_tokens=256, max_prefill_chunk_tokens=256, max_num_seqs=4)
    return Engine(None, num_blocks=64, block_size=BS, executor=ex, scheduler_config=sc,
                  event_sink=events.append), events


def _run(prompt) -> tuple[list, list]:
    eng, events = _engine()
    eng.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    outs = []
    while eng.has_unfinished():
        outs.extend((o.new_token_ids, o.finished, o.num_cached_tokens_by_tier) for o in eng.step())
    return outs, events


@pytest.mark.parametrize("dtype", ["<u4", "<i8", ">u2", "uint64"])
def test_array_prompt_runs_as_its_list(dtype):
    ids = [1 + (i * 7919) % 30000 for i in range(3 * BS + 5)]
    want = _run(ids)
    got = _run(np.array(ids, dtype=dtype))
    assert got == want and want[1], "same outputs and the same KV events (with the prompt's block hashes)"


def test_array_prompt_kept_as_python_ints():
    eng, _ = _engine()
    eng.add_request(EngineRequest("r", np.arange(1, 40, dtype="<u4"), SamplingParams(max_tokens=4), mode="prefill"))
    while eng.has_unfinished():
        eng.step()
    _, toks = eng.export_kv("r")  # prompt + first token, as the engine keeps them
    assert [type(t) for t in toks[:39]] == [int] * 39 and toks[:39] == list(range(1, 40))


@pytest.mark.parametrize("bad, msg", [
    (np.array([], dtype="<u4"), "must not be empty"),
    (np.array([5, -1, 3], dtype="<i4"), "token ids must be in"),
    (np.array([5, 1 << 31], dtype="<u8"), "token ids must be in"),
    (np.array([1 << 40], dtype="<i8"), "token ids must be in"),
])
def test_array_prompt_refused_as_its_list(bad, msg):
    eng, _ = _engine()
    with pytest.raises(ValueError, match=msg):
        eng.add_request(EngineRequest("a", bad))
    if bad.size:
        with pytest.raises(ValueError, match=msg):
            eng.add_request(EngineRequest("b", bad.tolist()))


def test_float_array_still_refused():
    eng, _ = _engine()
    with pytest.raises(ValueError, match="must be integers"):
        eng.add_request(EngineRequest("f", np.array([1.0, 2.0])))
