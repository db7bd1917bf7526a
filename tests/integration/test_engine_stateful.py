"""Never a wrong token, in any interleaving (hypothesis state machine over two real engines).

A prefill engine with a small L1 pool, an L2 host pool and a small L3 store it writes through to
(so prefix sharing, preemption under block pressure, L1 evictions, L2 spills and promotions, L3
loads of 2-block chunks and L3 evictions all happen) and a decode engine that continues handed-off requests (``import_held``) and runs
decode-local appends over the prefix blocks those registered. Rules, in any
order hypothesis finds: add a request (prompts from a few shared prefixes plus a random suffix;
whole on the prefill engine, or prefill there and decode on the other), abort a live request,
run steps on either engine, drop the prefix cache. After every rule both engines' pool
bookkeeping agrees with their requests' block tables; every request that finishes normally has
exactly the greedy tokens it gets alone on a fresh engine (the correctness oracle); at the end
both pools are back to baseline. CI runs 100 derandomized examples (the same ones every time);
``CPD_STATEFUL_EXPLORE=N`` runs N fresh random ones (a longer bug hunt).
"""
from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.scheduler import SchedulerConfig
from cpd.engine.weights import make_tiny_llama_dir
from cpd.store import open_store
from cpd.store.connector import L3Connector

BLOCK = 16
PREFIXES = [[int(x) for x in np.random.default_rng(900 + i).integers(10, 40000, size=n)] for i, n in
            enumerate((48, 70, 33))]
SCHED = SchedulerConfig(max_num_batched_tokens=64, max_prefill_chunk_tokens=32, max_num_seqs=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("stateful") / "m", seed=3))


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class EngineInterleavings(RuleBasedStateMachine):
    model_dir: str = ""
    oracle_engine: Engine | None = None
    oracle_cache: dict[tuple, list[int]] = {}
    seen: dict[str, int] = {}  # over all runs: what the interleavings exercised

    @initialize()
    def start(self) -> None:
        store = open_store(f"mem://stateful-{uuid.uuid4().hex}", chunk_blocks=2,
                           capacity_bytes=12 * self._block_bytes())
        self.pre = Engine(self.model_dir, num_blocks=14, host_kv_bytes=16 * self._block_bytes(),
                          scheduler_config=SCHED, connector=L3Connector(store, write_async=False))
        self.dec = Engine(self.model_dir, num_blocks=14, scheduler_config=SCHED)
        self.n = 0
        self.live: dict[str, tuple[list[int], int, str]] = {}  # id -> (prompt, max_tokens, where)
        self.tokens: dict[str, list[int]] = {}
        self.aborted: set[str] = set()

    def _block_bytes(self) -> int:
        return EngineInterleavings.oracle().block_bytes

    @classmethod
    def oracle(cls) -> Engine:
        if cls.oracle_engine is None:
            cls.oracle_engine = Engine(cls.model_dir, num_blocks=256)
        return cls.oracle_engine

    def _expected(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self.oracle_cache:
            self.oracle_cache[key] = self.oracle().generate(prompt, _greedy(max_tokens))
        return self.oracle_cache[key]

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), suffix_len=st.integers(1, 40), seed=st.integers(0, 3),
          max_tokens=st.integers(1, 24), path=st.sampled_from(["full", "handoff", "append"]),
          write_through=st.booleans())
    def add(self, prefix: int, suffix_len: int, seed: int, max_tokens: int, path: str, write_through: bool) -> None:
        """``full``: prefill and decode on the prefill engine; ``handoff``: prefill there, decode on
        the decode engine; ``append``: all on the decode engine, over the prefix blocks its
        handed-off requests registered (a decode-local append)."""
        suffix = [int(x) for x in np.random.default_rng(seed * 100 + suffix_len).integers(10, 40000, size=suffix_len)]
        prompt = PREFIXES[prefix] + suffix
        rid = f"r{self.n}"
        self.n += 1
        if path == "append":
            self.dec.add_request(EngineRequest(rid, prompt, _greedy(max_tokens)))
        else:
            self.pre.add_request(EngineRequest(rid, prompt, _greedy(max_tokens),
                                               mode="prefill" if path == "handoff" else "full",
                                               write_through=write_through))
        self.live[rid] = (prompt, max_tokens, "dec" if path == "append" else "pre")
        self.tokens[rid] = []

    @precondition(lambda self: bool(self.live))
    @rule(pick=st.integers(0, 1 << 30), really=st.integers(0, 2))
    def abort(self, pick: int, really: int) -> None:
        if really:  # one abort in three: most requests should run to the end and be checked
            return
        rid = sorted(self.live)[pick % len(self.live)]
        engine = self.pre if self.live[rid][2] == "pre" else self.dec
        engine.abort(rid)
        self.aborted.add(rid)

    @rule(steps=st.integers(1, 6))
    def step_prefill(self, steps: int) -> None:
        for _ in range(steps):
            self._collect(self.pre, self.pre.step())

    @rule(steps=st.integers(1, 6))
    def step_decode(self, steps: int) -> None:
        for _ in range(steps):
            self._collect(self.dec, self.dec.step())

    @rule()
    def drop_prefix_cache(self) -> None:
        self.pre.reset_prefix_cache()

    def _collect(self, engine: Engine, outputs) -> None:
        for o in outputs:
            self.tokens[o.request_id].extend(o.new_token_ids)
            for tier, n in (o.num_cached_tokens_by_tier or {}).items():
                self._count(f"cached_from_{tier}", int(n > 0))
            if not o.finished:
                continue
            prompt, max_tokens, _ = self.live[o.request_id]
            if o.finish_reason == "handoff":
                self._hand_off(o.request_id)
                self.live[o.request_id] = (prompt, max_tokens, "dec")
                if o.request_id in self.aborted:  # aborted while held: the decode side drops it too
                    self.dec.abort(o.request_id)
                continue
            del self.live[o.request_id]
            if o.finish_reason == "abort":
                assert o.request_id in self.aborted, o
                continue
            assert o.finish_reason == "length", o
            assert self.tokens[o.request_id] == self._expected(prompt, max_tokens), o.request_id
            self._count("checked_on_decode_engine" if engine is self.dec else "checked")
            if engine is self.dec and o.num_cached_tokens_by_tier:  # only an append's own first output has it
                self._count("append_prefix_hits", int(sum(o.num_cached_tokens_by_tier.values()) > 0))

    def _hand_off(self, rid: str) -> None:
        """To the decode engine: in process (``import_held``) for even request numbers, as the
        wire carries it for odd ones (the exported KV as host bytes, the receiver's own copy of
        them into :meth:`Engine.add_decode_request`, as the worker's TCP/shm paths do)."""
        if int(rid[1:]) % 2 == 0:
            self.dec.import_held(self.pre, rid)
        else:
            kv, token_ids = self.pre.export_kv(rid)
            host = self.pre.arrays.to_numpy(kv)
            wire = np.frombuffer(host.tobytes(), dtype=host.dtype).reshape(host.shape).copy()  # the receiver's copy
            prompt, max_tokens, _ = self.live[rid]
            self.dec.add_decode_request(rid, token_ids, wire, _greedy(max_tokens), len(token_ids) - len(prompt))
            self._count("handoffs_over_the_wire")
        self.pre.release(rid)

    def _count(self, what: str, n: int = 1) -> None:
        self.seen[what] = self.seen.get(what, 0) + n

    @invariant()
    def pools_agree_with_block_tables(self) -> None:
        if hasattr(self, "pre"):
            self.pre.check_invariants()
            self.dec.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "pre"):
            return
        for _ in range(2000):
            if not (self.pre.has_unfinished() or self.dec.has_unfinished()):
                break
            self._collect(self.pre, self.pre.step())
            self._collect(self.dec, self.dec.step())
        assert not self.live, f"requests never finished: {sorted(self.live)}"
        for engine in (self.pre, self.dec):
            engine.check_invariants()
            assert engine.pool.stats()["num_in_use"] == 0
        self._count("preemptions", self.pre.num_preemptions + self.dec.num_preemptions)
        self._count("l1_evictions", self.pre.pool.stats()["num_evictions"])
        self._count("aborted", len(self.aborted))


def test_engine_interleavings_give_the_oracle_tokens(model_dir):
    EngineInterleavings.model_dir = model_dir
    EngineInterleavings.oracle_engine = None
    EngineInterleavings.oracle_cache = {}
    EngineInterleavings.seen = {}
    run = EngineInterleavings.TestCase
    explore = int(os.environ.get("CPD_STATEFUL_EXPLORE", "0"))  # > 0: that many fresh random runs
    run.settings = settings(max_examples=explore or 100, stateful_step_count=50, deadline=None,
                            derandomize=not explore, suppress_health_check=list(HealthCheck))
    run().runTest()
    seen = EngineInterleavings.seen
    print(seen)
    for what in ("checked", "checked_on_decode_engine", "append_prefix_hits", "handoffs_over_the_wire", "preemptions", "l1_evictions", "aborted", "cached_from_L1",
                 "cached_from_L2", "cached_from_L3"):
        assert seen.get(what, 0) > 0, f"no interleaving exercised {what}: {seen}"


def test_preempting_a_request_that_shares_its_prefix_never_overallocates(model_dir):
    """The case the state machine found: three requests share one prefix and a fourth has its
    own in a 14-block pool; a preemption counted the victim's shared prefix blocks as freed, the
    step then found fewer free blocks than planned, and one request failed ("block table of 3
    blocks cannot hold 71 tokens"). Every request gets the oracle's tokens."""
    engine = Engine(model_dir, num_blocks=14, scheduler_config=SCHED)
    prompts = {}
    for i, (prefix, suffix_len, max_tokens) in enumerate([(0, 32, 2), (0, 1, 3), (1, 1, 1), (0, 1, 2)]):
        suffix = [int(x) for x in np.random.default_rng(suffix_len).integers(10, 40000, size=suffix_len)]
        prompts[f"r{i}"] = (PREFIXES[prefix] + suffix, max_tokens)
        engine.add_request(EngineRequest(f"r{i}", PREFIXES[prefix] + suffix, _greedy(max_tokens)))
    tokens: dict[str, list[int]] = {}
    reasons = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        engine.check_invariants()
    assert engine.num_preemptions > 0 and set(reasons.values()) == {"length"}, reasons
    oracle = Engine(model_dir, num_blocks=256)
    for rid, (prompt, max_tokens) in prompts.items():
        assert tokens[rid] == oracle.generate(prompt, _greedy(max_tokens)), rid
    assert engine.pool.stats()["num_in_use"] == 0
