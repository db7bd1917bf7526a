"""Engine behaviour on a tiny random Llama: prefix cache, chunking, batching, L2, L3,
handoff, abort, seeds, events, preemption. Every engine must end with no block in use."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from cpd.engine.engine import Engine, EngineRequest, StepOutput
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.engine.weights import make_tiny_llama_dir
from cpd.kv.block_hash import hash_blocks
from cpd.kv.events import MEDIUM_L1, MEDIUM_L2, AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "m", seed=5)


@pytest.fixture
def make_engine(model_dir):
    """Factory; after the test every engine it built must be back to baseline."""
    engines: list[Engine] = []

    def make(**kw) -> Engine:
        kw.setdefault("num_blocks", 64)
        kw.setdefault("block_size", BS)
        e = Engine(model_dir, **kw)
        engines.append(e)
        return e

    yield make
    for e in engines:
        assert not e.has_unfinished()
        assert e.pool.stats()["num_in_use"] == 0, e.pool.stats()
        e.check_invariants()


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


def run_all(e: Engine, reqs: list[EngineRequest]) -> dict[str, list[StepOutput]]:
    for r in reqs:
        e.add_request(r)
    out: dict[str, list[StepOutput]] = {}
    for _ in range(10000):
        if not e.has_unfinished():
            break
        for o in e.step():
            out.setdefault(o.request_id, []).append(o)
    return out


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def oracle(model_dir):
    """Reference tokens: each prompt alone on a fresh, roomy engine."""
    cache = {}

    def ref(p: list[int], sp: SamplingParams = GREEDY) -> list[int]:
        key = (tuple(p), sp)
        if key not in cache:
            e = Engine(model_dir, num_blocks=64, block_size=BS)
            cache[key] = e.generate(p, sp)
        return cache[key]

    return ref


def test_prefix_cache_hit_same_tokens(make_engine, oracle):
    e = make_engine()
    base = prompt(1, 22)
    assert e.generate(base, GREEDY) == oracle(base)
    longer = base + prompt(2, 7)
    out = run_all(e, [EngineRequest("b", longer, GREEDY)])["b"]
    assert tokens(out) == oracle(longer)
    # the 5 full blocks of `base` (20 tokens) came from L1
    assert out[0].num_cached_tokens_by_tier == {"L1": 20, "L2": 0, "L3": 0}
    assert out[-1].finished and out[-1].finish_reason == "length"
    # exact repeat: everything but the last token's block is cached
    out = run_all(e, [EngineRequest("c", base, GREEDY)])["c"]
    assert tokens(out) == oracle(base) and out[0].num_cached_tokens_by_tier["L1"] == 20
    # a different cache_salt never shares blocks
    out = run_all(e, [EngineRequest("d", base, GREEDY, cache_salt="tenant-x")])["d"]
    assert tokens(out) == oracle(base) and out[0].num_cached_tokens_by_tier["L1"] == 0


def test_chunked_prefill_same_tokens(make_engine, oracle):
    e = make_engine(scheduler_config=SchedulerConfig(max_num_batched_tokens=16, max_prefill_chunk_tokens=5))
    p = prompt(3, 31)
    assert e.generate(p, GREEDY) == oracle(p)


def test_batched_decode_equals_one_at_a_time(make_engine, oracle):
    e = make_engine(scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk_tokens=16))
    ps = [prompt(10 + i, 5 + 7 * i) for i in range(4)]
    out = run_all(e, [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert tokens(out[f"r{i}"]) == oracle(p)
    assert e.num_steps < 4 * (GREEDY.max_tokens + 1)  # they really ran together


def test_batched_decode_very_different_lengths(make_engine, oracle):
    """Decode rows of 3 .. 150 tokens (1 .. 38 blocks, padded to the longest) attended to in
    one batch give the same greedy tokens as each sequence alone; also with a prefill chunk
    in the same step, and on the per-sequence reference path."""
    lens = [3, 150, 17, 64, 1, 97]
    ps = [prompt(40 + i, n) for i, n in enumerate(lens)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    for batched in (True, False):
        e = make_engine(num_blocks=256, scheduler_config=SchedulerConfig(max_num_batched_tokens=48,
                                                                         max_prefill_chunk_tokens=32))
        e.model.batched_decode = batched
        out = run_all(e, [EngineRequest(f"r{i}", p, sp) for i, p in enumerate(ps)])
        for i, p in enumerate(ps):
            assert tokens(out[f"r{i}"]) == oracle(p, sp), (batched, i)


def test_batched_decode_sampled_and_greedy_mixed(make_engine, oracle):
    """A step with greedy and seeded-sampled rows samples each row by its own parameters."""
    seeded = SamplingParams(max_tokens=6, temperature=0.8, top_k=50, seed=11, ignore_eos=True)
    p1, p2 = prompt(60, 9), prompt(61, 23)
    e = make_engine()
    out = run_all(e, [EngineRequest("g", p1, GREEDY), EngineRequest("s", p2, seeded)])
    assert tokens(out["g"]) == oracle(p1)
    assert tokens(out["s"]) == oracle(p2, seeded)


@pytest.mark.parametrize("swap_space_bytes", [0, 1 << 30], ids=["recompute", "swap"])
def test_preemption_under_block_pressure(make_engine, oracle, swap_space_bytes):
    # 12 blocks of 4 tokens; four requests that each need up to 5 blocks
    e = make_engine(num_blocks=12, scheduler_config=SchedulerConfig(max_num_batched_tokens=32),
                    swap_space_bytes=swap_space_bytes)
    ps = [prompt(20 + i, 11) for i in range(4)]
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    out = run_all(e, [EngineRequest(f"r{i}", p, sp) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert tokens(out[f"r{i}"]) == oracle(p, sp)
    assert e.num_preemptions > 0
    # swap space: every victim's KV came back as it was (none recomputed); none: all recomputed
    assert e.num_swapped_preemptions == (e.num_preemptions if swap_space_bytes else 0)


def test_swap_space_bounds_the_swapped_kv_and_past_it_preemption_recomputes(make_engine, oracle):
    """With room for one victim's KV at a time, later victims are recomputed while it waits; the
    tokens stay the oracle's either way and every block comes back."""
    e = make_engine(num_blocks=12, scheduler_config=SchedulerConfig(max_num_batched_tokens=32))
    e.swap_space_bytes = 16 * e.kv_bytes_per_token  # one victim of at most 16 computed tokens
    ps = [prompt(40 + i, 11) for i in range(5)]
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    out = run_all(e, [EngineRequest(f"r{i}", p, sp) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert tokens(out[f"r{i}"]) == oracle(p, sp)
    assert 0 < e.num_swapped_preemptions < e.num_preemptions


def test_l2_promotion(make_engine, oracle):
    ev = []
    e = make_engine(num_blocks=9, host_kv_bytes=64 * 1024, event_sink=ev.append)
    assert e.host_pool.num_slots == 64 * 1024 // e.block_bytes
    a = prompt(30, 21)
    assert e.generate(a, GREEDY) == oracle(a)
    # another prompt evicts a's cached blocks out of the 9-block L1 into L2
    b = prompt(31, 21)
    assert e.generate(b, GREEDY) == oracle(b)
    assert any(isinstance(x, BlockStored) and x.medium == MEDIUM_L2 for x in ev)
    out = run_all(e, [EngineRequest("a2", a, GREEDY)])["a2"]
    assert tokens(out) == oracle(a)
    tiers = out[0].num_cached_tokens_by_tier
    assert tiers["L2"] > 0 and tiers["L1"] + tiers["L2"] == 20
    assert e.host_pool.stats()["num_hits"] > 0


class DictConnector:
    """In-memory stand-in for the L3 store (the contract of cpd.engine.connector)."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}
        self.saves = 0
        self.fail_load = False
        self.raise_lookup = False

    def lookup(self, block_hashes):
        if self.raise_lookup:
            raise ConnectionError("store down")
        n = 0
        for h in block_hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def load(self, block_hashes):
        if self.fail_load:
            return None
        return [self.blocks[h].copy() for h in block_hashes]

    def save(self, block_hashes, parent_block_hash, token_ids, blocks):
        self.saves += 1
        assert len(token_ids) == len(blocks) * BS
        for h, b in zip(block_hashes, blocks):
            assert b.flags.c_contiguous
            self.blocks[h] = np.array(b)


def test_l3_write_through_and_load(make_engine, oracle):
    store = DictConnector()
    pre = make_engine(connector=store)
    p = prompt(40, 26)  # 6 full prompt blocks
    out = run_all(pre, [EngineRequest("w", p, SamplingParams(max_tokens=5), write_through=True, mode="prefill")])
    assert out["w"][-1].finish_reason == "handoff"
    pre.release("w")
    assert len(store.blocks) == 6
    warm = make_engine(connector=store)
    out = run_all(warm, [EngineRequest("x", p, GREEDY)])["x"]
    assert tokens(out) == oracle(p) and out[0].num_cached_tokens_by_tier == {"L1": 0, "L2": 0, "L3": 24}
    # router limits L3 loading to 2 blocks
    lim = make_engine(connector=store)
    out = run_all(lim, [EngineRequest("y", p, GREEDY, max_l3_blocks=2)])["y"]
    assert tokens(out) == oracle(p) and out[0].num_cached_tokens_by_tier["L3"] == 8
    # faults: a failed load or an unreachable store means recompute, same tokens
    store.fail_load = True
    out = run_all(make_engine(connector=store), [EngineRequest("z", p, GREEDY)])["z"]
    assert tokens(out) == oracle(p) and out[0].num_cached_tokens_by_tier["L3"] == 0
    store.fail_load, store.raise_lookup = False, True
    assert make_engine(connector=store).generate(p, GREEDY) == oracle(p)


def test_handoff_between_engines(make_engine, oracle):
    p = prompt(50, 18)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    pf = make_engine()
    out = run_all(pf, [EngineRequest("h", p, sp, mode="prefill")])["h"]
    assert len(out) == 1 and out[0].finished and out[0].finish_reason == "handoff"
    assert pf.pool.stats()["num_in_use"] > 0 and not pf.has_unfinished()
    kv, toks = pf.export_kv("h")
    assert kv.shape == (2, 2, 18, 2, 16) and kv.is_contiguous() and toks == p + out[0].new_token_ids
    pf.release("h")
    ev = []
    dec = make_engine(event_sink=ev.append)
    dec.add_decode_request("h", toks, kv, sp, num_generated=1)
    rest = []
    while dec.has_unfinished():
        for o in dec.step():
            rest.extend(o.new_token_ids)
    assert toks[len(p):] + rest == oracle(p, sp)
    # the imported prompt's full blocks were registered in the decode side's prefix cache
    stored = [x for x in ev if isinstance(x, BlockStored) and x.medium == MEDIUM_L1]
    assert stored[0].token_ids == p[:BS * len(stored[0].block_hashes)]  # the run of imported blocks
    assert len(dec.pool.match(hash_blocks(p, dec.namespace))) == 4


def test_seeded_sampling_reproducible(make_engine):
    p = prompt(60, 9)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    e1, e2 = make_engine(), make_engine()
    a = e1.generate(p, sp)
    assert a == e2.generate(p, sp) == e1.generate(p, sp)
    assert a != e1.generate(p, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=12,
                                              ignore_eos=True))
    # seeded sampling is path independent: prefill + handoff + decode gives the same tokens
    pf = make_engine()
    first = run_all(pf, [EngineRequest("s", p, sp, mode="prefill")])["s"][0].new_token_ids
    kv, toks = pf.export_kv("s")
    pf.release("s")
    dec = make_engine()
    dec.add_decode_request("s", toks, kv, sp)
    rest = tokens(run_all(dec, [])["s"])
    assert first + rest == a


def test_abort_frees_blocks(make_engine):
    e = make_engine(scheduler_config=SchedulerConfig(max_num_seqs=1))
    e.add_request(EngineRequest("a", prompt(70, 30), SamplingParams(max_tokens=100, ignore_eos=True)))
    e.add_request(EngineRequest("b", prompt(71, 30), SamplingParams(max_tokens=100, ignore_eos=True)))
    e.step()
    e.step()
    assert e.pool.stats()["num_in_use"] >= 8
    e.abort("a")
    e.abort("b")  # still waiting
    assert e.pool.stats()["num_in_use"] == 0  # freed at once (no step running)
    outs = e.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {("a", "abort"), ("b", "abort")}
    assert not e.has_unfinished()
    e.abort("nope")  # unknown ids are ignored
    # a held prefill request can be aborted as well
    run_all(e, [EngineRequest("c", prompt(72, 9), SamplingParams(max_tokens=5), mode="prefill")])
    e.abort("c")
    assert e.pool.stats()["num_in_use"] == 0


def test_stop_on_eos_and_validation(make_engine, model_dir):
    e = make_engine()
    p = prompt(80, 10)
    free_run = e.generate(p, GREEDY)
    stop_tok = free_run[3]
    out = run_all(e, [EngineRequest("s", p, SamplingParams(max_tokens=8, stop_token_ids=(stop_tok,)))])["s"]
    assert tokens(out) == free_run[:free_run.index(stop_tok) + 1] and out[-1].finish_reason == "stop"
    with pytest.raises(ValueError):
        e.add_request(EngineRequest("bad", [], GREEDY))
    with pytest.raises(ValueError):
        e.add_request(EngineRequest("bad", [e.vocab_size], GREEDY))
    with pytest.raises(ValueError):
        e.add_request(EngineRequest("bad", [1] * e.max_model_len, GREEDY))
    with pytest.raises(ValueError):
        e.add_request(EngineRequest("bad", [1], GREEDY, mode="other"))
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    e.add_request(EngineRequest("dup", p, GREEDY))
    with pytest.raises(ValueError):
        e.add_request(EngineRequest("dup", p, GREEDY))
    e.abort("dup")
    e.step()
    assert e.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 and e.block_bytes == 4 * e.kv_bytes_per_token
    assert e.eos_token_id is not None and e.namespace.block_size == BS


def test_events_and_reset(make_engine):
    ev = []
    e = make_engine(num_blocks=6, event_sink=ev.append)
    e.generate(prompt(90, 13), GREEDY)  # 13 + 8 tokens -> 5 full blocks computed
    stored = [x for x in ev if isinstance(x, BlockStored)]  # one event per run of newly full blocks
    chain = [h for x in stored for h in x.block_hashes]
    assert len(chain) == 5 and all(x.medium == MEDIUM_L1 and x.block_size == BS for x in stored)
    starts = [sum(len(y.block_hashes) for y in stored[:i]) for i in range(len(stored))]
    assert [x.parent_block_hash for x in stored] == [chain[s - 1] if s else None for s in starts]
    assert all(len(x.token_ids) == BS * len(x.block_hashes) for x in stored)
    e.generate(prompt(91, 13), GREEDY)  # needs blocks -> evicts cached ones
    removed = [x for x in ev if isinstance(x, BlockRemoved)]
    assert removed and all(x.medium == MEDIUM_L1 for x in removed)
    e.reset_prefix_cache()
    assert isinstance(ev[-1], AllBlocksCleared) and e.pool.stats()["num_cached"] == 0


def test_threaded_add_while_stepping(make_engine, oracle):
    e = make_engine()
    ps = [prompt(100 + i, 6 + i) for i in range(4)]
    outs: dict[str, list[int]] = {}
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            time.sleep(0.001)

    t = threading.Thread(target=loop)
    t.start()
    try:
        for i, p in enumerate(ps):
            e.add_request(EngineRequest(f"t{i}", p, GREEDY))
            time.sleep(0.01)
        deadline = time.time() + 60
        while (len(outs) < 4 or e.has_unfinished()) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join()
    for i, p in enumerate(ps):
        assert outs[f"t{i}"] == oracle(p)
    st = e.load_stats()
    assert st["running_requests"] == 0 and st["queued_prefill_tokens"] == 0 and st["kv_usage"] == 0


def test_mixed_workload_stress(make_engine, oracle):
    """Shared prefixes, a small L1 with L2 and L3 behind it, chunking, preemption, aborts,
    a handoff import: every completed request matches the oracle; invariants hold each step."""
    import random

    rnd = random.Random(0)
    store = DictConnector()
    e = make_engine(num_blocks=12, host_kv_bytes=16 * 2 * 2 * BS * 2 * 16 * 4, connector=store,
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=24, max_prefill_chunk_tokens=9,
                                                     max_num_seqs=3))
    bases = [prompt(200 + i, 12) for i in range(4)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    reqs, aborted = [], set()
    for i in range(16):
        p = bases[rnd.randrange(4)] + prompt(300 + i, rnd.randrange(1, 9))
        reqs.append(EngineRequest(f"q{i}", p, sp, write_through=(i % 4 == 0), max_l3_blocks=rnd.choice([None, 1])))
    # a handed-off request from another engine joins the mix
    pf = make_engine()
    hp = bases[0] + prompt(999, 5)
    first = run_all(pf, [EngineRequest("h", hp, sp, mode="prefill")])["h"][0].new_token_ids
    kv, toks = pf.export_kv("h")
    pf.release("h")
    got: dict[str, list[int]] = {}
    tiers = {"L1": 0, "L2": 0, "L3": 0}
    pending = list(reqs)
    e.add_decode_request("h", toks, kv, sp)
    got["h"] = list(first)
    for step in range(2000):
        if pending and rnd.random() < 0.5:
            e.add_request(pending.pop(0))
        if step in (7, 15):
            victim = rnd.choice(reqs).request_id
            aborted.add(victim)
            e.abort(victim)
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            for k, v in (o.num_cached_tokens_by_tier or {}).items():
                tiers[k] += v
        e.check_invariants()
        if not pending and not e.has_unfinished():
            break
    assert not e.has_unfinished()
    for r in reqs:
        if r.request_id not in aborted:
            assert got[r.request_id] == oracle(list(r.prompt_token_ids), sp), r.request_id
    assert got["h"] == oracle(hp, sp)
    assert e.host_pool.stats()["num_stores"] > 0 and store.saves > 0
    # the mix really exercised every tier and preemption (deterministic seeds)
    assert tiers["L1"] > 0 and tiers["L2"] > 0 and tiers["L3"] > 0 and e.num_preemptions > 0


def test_first_output_carries_the_batch_step_figures(make_engine):
    """Requests prefilled in one step report the step's tokens, all of them together, and its
    seconds (the router's batch-unbiased rate sample); a later request only its own steps'."""
    e = make_engine(scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_prefill_chunk_tokens=512))
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    outs = run_all(e, [EngineRequest(f"r{i}", prompt(900 + i, 24), sp) for i in range(10)])
    firsts = [outs[f"r{i}"][0] for i in range(10)]
    assert all(o.step_tokens == 240 and o.step_s is not None and o.step_s > 0 for o in firsts), firsts
    assert len({o.step_s for o in firsts}) == 1
    later = run_all(e, [EngineRequest("late", prompt(950, 40), sp)])["late"][0]
    assert later.step_tokens == 40 and e.step_tokens_total == 280
