"""The modeled executor on the real engine: step and transfer waits equal the cost model's,
dilation scales them, pseudo tokens are path-independent, block accounting is the same for the
same request sequence, pools return to baseline, and no torch is imported."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from cpd.engine.engine import Engine, EngineRequest, SamplingParams
from cpd.engine.executor_modeled import ModeledExecutor, ModeledModelConfig, build_modeled_executor, pseudo_token
from cpd.policy.cost_model import RooflineCostModel
from cpd.engine.scheduler import SchedulerConfig

BS = 16


class RecordingClock:
    """A virtual clock: records every wait instead of sleeping."""

    def __init__(self):
        self.waits: list[float] = []

    def wait(self, seconds: float) -> None:
        self.waits.append(seconds)


def _engine(clock=None, dilation=1.0, num_blocks=256, host_kv_bytes=0, chunk=512):
    ex = build_modeled_executor("llama-3.1-8b", "b200", 4, time_dilation=dilation, clock=clock or RecordingClock())
    sc = SchedulerConfig(max_num_batched_tokens=chunk, max_prefill_chunk_tokens=chunk, max_num_seqs=8)
    return Engine(None, num_blocks=num_blocks, block_size=BS, host_kv_bytes=host_kv_bytes, executor=ex,
                  scheduler_config=sc), ex


def _prompt(n: int, base: int = 1000) -> list[int]:
    return [base + (i * 7919) % 50000 for i in range(n)]


def test_step_waits_equal_cost_model_step_times():
    clock = RecordingClock()
    eng, ex = _engine(clock)
    cm = RooflineCostModel.build("Llama-3.1-8B", "b200", 4)
    out = eng.generate(_prompt(1000), SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out) == 3
    expected = [cm.step_time_s([(512, 0)]), cm.step_time_s([(488, 512)]),
                cm.step_time_s((), 1000, 1), cm.step_time_s((), 1001, 1)]
    assert clock.waits == pytest.approx(expected, rel=1e-12)
    assert ex.busy_s == pytest.approx(sum(expected), rel=1e-12)


def test_time_dilation_multiplies_every_wait():
    c1, c4 = RecordingClock(), RecordingClock()
    e1, _ = _engine(c1, dilation=1.0)
    e4, _ = _engine(c4, dilation=4.0)
    p = _prompt(700)
    assert e1.generate(p, SamplingParams(max_tokens=4)) == e4.generate(p, SamplingParams(max_tokens=4))
    assert c4.waits == pytest.approx([4 * w for w in c1.waits], rel=1e-12)


def test_l2_promotion_waits_the_modeled_transfer_time():
    clock = RecordingClock()
    eng, ex = _engine(clock, num_blocks=40, host_kv_bytes=64 << 30)  # 64 GiB modeled L2
    waits: list[tuple[str, float]] = []
    ex.on_wait = lambda what, s: waits.append((what, s))
    a, b = _prompt(320, 1000), _prompt(600, 9000)
    eng.generate(a, SamplingParams(max_tokens=1))
    eng.generate(b, SamplingParams(max_tokens=1))  # evicts most of a's L1 blocks into L2
    waits.clear()
    eng.add_request(EngineRequest("again", a, SamplingParams(max_tokens=1)))
    first = None
    while first is None:
        first = next((o for o in eng.step() if o.request_id == "again"), None)
    n_l2 = first.num_cached_tokens_by_tier["L2"]
    assert n_l2 >= 10 * BS
    l2 = [s for what, s in waits if what == "L2"]
    assert l2 == pytest.approx([ex.cost_model.transfer_time_s("L2", n_l2 * ex.kv_bytes_per_token)], rel=1e-12)


def _prefill_to_handoff(pre: Engine, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    """Run a ``"prefill"``-mode request on ``pre`` until its first output; that output's tokens."""
    pre.add_request(EngineRequest(rid, prompt, sp, mode="prefill"))
    first: list = []
    while not first:
        first = [o for o in pre.step() if o.request_id == rid]
    return list(first[0].new_token_ids)


def _decode_to_end(dec: Engine, rid: str) -> list[int]:
    """Step ``dec`` until it has nothing left; the tokens ``rid`` produced."""
    got: list[int] = []
    while dec.has_unfinished():
        got += [t for o in dec.step() if o.request_id == rid for t in o.new_token_ids]
    return got


def test_pseudo_tokens_are_path_independent_through_a_handoff():
    p = _prompt(333)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    one, _ = _engine()
    want = one.generate(p, sp)
    pre, _ = _engine()
    dec, ex_dec = _engine()
    first = _prefill_to_handoff(pre, "r", p, sp)
    kv, toks = pre.export_kv("r")
    assert kv.shape == (1, 2, len(toks) - 1, 1, ex_dec.kv_layout.head_dim)
    pre.release("r")
    dec.add_decode_request("r", toks, kv, sp, num_generated=1)
    got = first + _decode_to_end(dec, "r")
    assert got == want
    assert want == [pseudo_token(p + want[:i], len(p) + i, one.vocab_size) for i in range(6)]
    for e in (one, pre, dec):
        e.check_invariants()
        assert e.pool_stats()["num_in_use"] == 0


def test_bad_prompts_are_refused_with_value_error_and_integers_of_any_kind_are_converted():
    eng, _ = _engine()
    v = eng.vocab_size
    for i, bad in enumerate(([], [1, 2.5], [1, "3"], [None], [-1], [v], [2**32], [2**70], [1] * eng.max_model_len)):
        with pytest.raises(ValueError):
            eng.add_request(EngineRequest(f"bad{i}", bad, SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError):
        eng.add_decode_request("bad-kv", [1, 2.0], None, SamplingParams(max_tokens=1))
    assert not eng.has_unfinished() and eng.pool_stats()["num_in_use"] == 0
    p = _prompt(40)
    want = eng.generate(p, SamplingParams(max_tokens=3, ignore_eos=True))
    other, _ = _engine()
    assert other.generate(np.array(p, dtype=np.int64), SamplingParams(max_tokens=3, ignore_eos=True)) == want
    eng.check_invariants()


def test_import_held_continues_like_add_decode_request_and_checks_the_receivers_vocab():
    """The in-process handoff (Engine.import_held) gives the same tokens and pool state as
    export_kv + add_decode_request; ids outside the receiver's vocabulary are still refused."""
    p = _prompt(333)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = []
    for in_process in (False, True):
        pre, _ = _engine()
        dec, _ = _engine()
        first = _prefill_to_handoff(pre, "r", p, sp)
        if in_process:
            dec.import_held(pre, "r")
        else:
            kv, toks = pre.export_kv("r")
            dec.add_decode_request("r", toks, kv, sp, num_generated=1)
        pre.release("r")
        got = first + _decode_to_end(dec, "r")
        for e in (pre, dec):
            e.check_invariants()
            assert e.pool_stats()["num_in_use"] == 0
        runs.append((got, dec.pool.stats(), sorted(dec.pool.cached)))
    assert runs[0] == runs[1] and len(runs[0][0]) == 6
    pre, _ = _engine()
    cm = RooflineCostModel.build("Llama-3.1-8B", "b200", 4)
    small_vocab = ModeledModelConfig(vocab_size=1000, max_position_embeddings=cm.model.max_context)  # ids here >= 1000
    small = Engine(None, num_blocks=256, block_size=BS, executor=ModeledExecutor(cm, small_vocab, clock=RecordingClock()))
    _prefill_to_handoff(pre, "r", p, sp)
    with pytest.raises(ValueError):
        small.import_held(pre, "r")
    with pytest.raises(TypeError):
        small.import_held(object(), "r")  # type: ignore[arg-type]
    with pytest.raises(KeyError):
        small.import_held(pre, "not-held")
    pre.release("r")
    pre.step()
    assert pre.pool_stats()["num_in_use"] == 0 and not small.has_unfinished()


def test_same_request_sequence_same_tokens_and_block_accounting():
    def run():
        eng, _ = _engine(num_blocks=64, host_kv_bytes=8 << 30)
        shared = _prompt(256, 5)
        outs = []
        for i in range(6):
            tail = _prompt(40 + 30 * i, 70000 + i)
            outs.append(eng.generate(shared + tail, SamplingParams(max_tokens=5)))
        eng.check_invariants()
        return outs, eng.pool_stats(), eng.cached_block_hashes()
    a, b = run(), run()
    assert a == b
    assert a[1]["num_in_use"] == 0


def test_kv_payload_is_the_documented_fraction():
    eng, ex = _engine()
    assert ex.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # Llama-3.1-8B, BF16 KV: 128 KiB per token
    assert ex.payload_bytes_per_token == ex.kv_bytes_per_token // 8192
    assert eng.kv_bytes_per_token == ex.kv_bytes_per_token


def test_modeled_engine_does_not_import_torch():
    code = ("import sys\n"
            "from cpd.engine.engine import Engine\n"
            "from cpd.engine.executor_modeled import build_modeled_executor\n"
            "from cpd.engine.engine import SamplingParams\n"
            "e = Engine(None, num_blocks=64, host_kv_bytes=1 << 30, executor=build_modeled_executor())\n"
            "assert len(e.generate(list(range(1, 100)), SamplingParams(max_tokens=2))) == 2\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_l3_loads_report_modeled_bytes_over_the_modeled_transfer_time():
    """The worker reports ``Engine.l3_load_bytes / l3_load_seconds`` to the router, which turns
    them into its L3 bandwidth estimate: the bytes must be the modeled KV bytes (not the small
    payload) and the seconds must include the modeled (dilated) transfer wait."""
    from cpd.store import open_store
    from cpd.store.connector import L3Connector

    dilation = 50.0
    ex = build_modeled_executor("llama-3.1-8b", "b200", 4, time_dilation=dilation)  # a real (wall) clock
    store = open_store("mem://l3-counters", capacity_bytes=1 << 30)
    sc = SchedulerConfig(max_num_batched_tokens=512, max_prefill_chunk_tokens=512, max_num_seqs=8)
    writer = Engine(None, num_blocks=64, block_size=BS, executor=ex, scheduler_config=sc,
                    connector=L3Connector(store, write_async=False))
    prompt = _prompt(320)
    writer.add_request(EngineRequest("w", prompt, SamplingParams(max_tokens=1), write_through=True))
    while writer.has_unfinished():
        writer.step()
    reader = Engine(None, num_blocks=64, block_size=BS, executor=ex, scheduler_config=sc,
                    connector=L3Connector(store, write_async=False))
    reader.add_request(EngineRequest("r", prompt, SamplingParams(max_tokens=1)))
    first = None
    while first is None:
        first = next((o for o in reader.step() if o.request_id == "r"), None)
    n_l3 = first.num_cached_tokens_by_tier["L3"]
    assert n_l3 == (len(prompt) - 1) // BS * BS
    assert reader.l3_load_bytes == n_l3 * ex.kv_bytes_per_token
    modeled_s = ex.cost_model.transfer_time_s("L3", n_l3 * ex.kv_bytes_per_token) * dilation
    assert modeled_s < reader.l3_load_seconds < modeled_s + 1.0
    assert writer.l3_load_bytes == 0 and writer.l3_load_seconds == 0.0
