"""The pure step scheduler (cpd.engine.scheduler), shared by the engine and the simulator."""
from __future__ import annotations

from cpd.engine.scheduler import SchedulerConfig, SeqState, blocks_for, schedule

CFG = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=3, max_prefill_chunk_tokens=32, block_size=16)


def _seq(rid, num_tokens, computed=0, blocks=None):
    return SeqState(rid, num_tokens, computed, blocks if blocks is not None else blocks_for(computed, 16))


def test_running_first_then_fcfs_admission_within_budget_and_chunk():
    running = [_seq("dec", 101, 100)]  # decoding: 1 token
    waiting = [_seq("a", 100), _seq("b", 10), _seq("c", 10)]
    plan = schedule(running, waiting, num_free_blocks=100, cfg=CFG)
    assert [(s.request_id, s.num_new_tokens) for s in plan.scheduled] == [("dec", 1), ("a", 32), ("b", 10)]
    assert plan.admitted == ("a", "b") and plan.num_batched_tokens == 43  # max_num_seqs = 3 stops "c"


def test_no_overtaking_when_the_head_does_not_fit():
    waiting = [_seq("big", 64), _seq("small", 8)]
    plan = schedule([], waiting, num_free_blocks=1, cfg=CFG)  # "big" needs 2 blocks for its 32-token chunk
    assert plan.scheduled == () and plan.admitted == ()


def test_preempts_newest_running_when_blocks_run_out():
    running = [_seq("old", 33, 32, blocks=2), _seq("new", 17, 16, blocks=1)]
    plan = schedule(running, [], num_free_blocks=0, cfg=CFG)
    assert plan.preempted == ("new",)
    assert [(s.request_id, s.num_new_blocks) for s in plan.scheduled] == [("old", 1)]
    assert blocks_for(0, 16) == 0 and blocks_for(17, 16) == 2


def test_a_preempted_sequence_frees_only_the_blocks_it_holds_alone():
    """"new" holds 2 blocks, both shared with "old" (one prefix): preempting it frees none, so
    "old", which needs a block, cannot run on it either and is preempted too (it frees its one
    own block, never counted twice). Counting all of "new"'s blocks would schedule "old" on a
    block the pool does not have (the engine's NoFreeBlocks at allocation)."""
    running = [_seq("old", 49, 48, blocks=3), _seq("new", 33, 32, blocks=2)]
    own = {"old": 1, "new": 0}
    plan = schedule(running, [], num_free_blocks=0, cfg=CFG, freeable_blocks=own.__getitem__)
    assert plan.preempted == ("new", "old") and plan.scheduled == ()
    plan = schedule(running, [], num_free_blocks=0, cfg=CFG)  # no sharing: all of "new"'s blocks are freed
    assert plan.preempted == ("new",) and [(s.request_id, s.num_new_blocks) for s in plan.scheduled] == [("old", 1)]
    own["new"] = 1
    plan = schedule(running, [], num_free_blocks=0, cfg=CFG, freeable_blocks=own.__getitem__)
    assert plan.preempted == ("new",) and [(s.request_id, s.num_new_blocks) for s in plan.scheduled] == [("old", 1)]
