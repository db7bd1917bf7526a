"""cpd.traces: readers for every format (slices built here), clear errors, blocks, arrival model."""
from __future__ import annotations

import gzip
import json

import pytest

from cpd.traces import (ReplayOptions, TraceFormatError, Vocab, build_schedule, detect_format, read_trace,
                        sim_blocks)
from cpd.sim.workload import trace_workload

V = Vocab(500, (0, 1))


def cc_request(t, n_in, ids, out=10, typ="n", api=1.0, think=None):
    d = {"t": t, "type": typ, "in": n_in, "out": out, "hash_ids": ids, "api_time": api}
    if think is not None:
        d["think_time"] = think
    return d


def conversation(cid="trace_0001", tool=128, system=64):
    """Two parent turns, a subagent pair started after the first, a third turn, an s/n pair."""
    sub = {"t": 5.0, "type": "subagent", "agent_id": "a1", "subagent_type": "Explore", "tool_tokens": 64,
           "system_tokens": 0, "requests": [cc_request(0.0, 200, [100, 101, 102]),
                                             cc_request(2.0, 300, [100, 101, 102, 103], think=1.0)]}
    return {"id": cid, "block_size": 64, "hash_id_scope": "local", "tool_tokens": tool, "system_tokens": system,
            "requests": [cc_request(0.0, 260, [1, 2, 3, 4]),
                         sub,
                         cc_request(20.0, 650, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], think=3.0),
                         cc_request(40.0, 710, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], typ="s", think=4.0),
                         cc_request(41.0, 710, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], typ="n", think=0.0)]}


def write_cc(folder, convs, gz=True):
    folder.mkdir(exist_ok=True)
    for c in convs:
        data = json.dumps(c).encode()
        if gz:
            (folder / f"{c['id']}.json.gz").write_bytes(gzip.compress(data))
        else:
            (folder / f"{c['id']}.json").write_bytes(data)
    return folder


def independent_hit_ratio(convs):
    """Infinite-cache token hit ratio counted directly from the JSON: per conversation, the leading
    run of already-seen 64-token block ids (subagents in the conversation's id space)."""
    hit = tot = 0
    for c in convs:
        seen = set()
        flat = []
        for r in c["requests"]:
            flat += r["requests"] if r["type"] == "subagent" else [r]
        for r in flat:  # time order within a conversation is irrelevant to this count here
            k = 0
            while k < len(r["hash_ids"]) and r["hash_ids"][k] in seen:
                k += 1
            hit += 64 * k
            tot += r["in"]
            seen.update(r["hash_ids"])
    return hit / tot


def test_claude_code_folder_gzip_and_subagents(tmp_path):
    convs = [conversation("trace_0001"), conversation("trace_0002")]
    d = write_cc(tmp_path / "cc", convs)
    assert detect_format(d) == "claude_code"
    tr = read_trace(d)
    assert tr.format == "claude_code" and len(tr.sessions) == 2 and tr.num_requests() == 12
    assert tr.sessions[0].subagents[0].after_index == 0 and tr.sessions[0].subagents[0].session.role == "Explore"
    sched = build_schedule(tr, ReplayOptions(session_rate=0.5), V)
    hit = sum(q.cached_trace_tokens for q in sched) / sum(q.input_length for q in sched)
    assert hit == pytest.approx(independent_hit_ratio(convs))
    kinds = [q.kind for q in sched if q.session.startswith("trace_0001")]
    assert kinds.count("subagent") == 2 and kinds[0] == "cold"
    # conversations share nothing without a shared prefix: the same ids give different tokens
    a = next(q for q in sched if q.id == "trace_0001#0")
    b = next(q for q in sched if q.id == "trace_0002#0")
    assert a.prompt_len == b.prompt_len == 260 and a.prompt != b.prompt and b.reuse == 0
    # one file works too, and a plain .json
    write_cc(tmp_path / "plain", [conversation("trace_0003")], gz=False)
    assert read_trace(tmp_path / "plain" / "trace_0003.json").num_requests() == 6


def test_shared_prefix_fraction_maps_leading_blocks_to_one_prefix(tmp_path):
    d = write_cc(tmp_path / "cc", [conversation("trace_0001"), conversation("trace_0002")])
    tr = read_trace(d)
    sched = build_schedule(tr, ReplayOptions(session_rate=0.5, shared_prefix_fraction=1.0, tokens_per_block=8), V)
    a = next(q for q in sched if q.id == "trace_0001#0")
    b = next(q for q in sched if q.id == "trace_0002#0")
    # (128 + 64) / 64 = 3 blocks shared; block 4 stays per conversation
    assert a.hash_ids[:3] == b.hash_ids[:3] and a.hash_ids[3] != b.hash_ids[3]
    assert a.prompt[:24] == b.prompt[:24] and a.prompt[24:32] != b.prompt[24:32]
    later = a if a.arrival_s > b.arrival_s else b
    assert later.cached_trace_tokens == 3 * 64


def test_tokens_per_block_and_max_context_truncate_whole_blocks(tmp_path):
    tr = read_trace(write_cc(tmp_path / "cc", [conversation()]))
    full = build_schedule(tr, ReplayOptions(users=1, tokens_per_block=4), V)
    q = next(x for x in full if x.id == "trace_0001#1")
    assert q.block_lens == [4] * 10 + [round(10 * 4 / 64) or 1]  # 650 = 10 full blocks + 10-token tail
    cut = build_schedule(tr, ReplayOptions(users=1, tokens_per_block=4, max_context=300), V)
    c = next(x for x in cut if x.id == "trace_0001#1")
    assert c.truncated and c.block_lens == [4] * 4 and c.hash_ids == q.hash_ids[:4]
    assert c.prompt == q.prompt[:16]


def test_closed_loop_dependencies_subagents_and_users(tmp_path):
    tr = read_trace(write_cc(tmp_path / "cc", [conversation("trace_0001"), conversation("trace_0002")]))
    s = build_schedule(tr, ReplayOptions(users=1), V)
    ix = {q.id: i for i, q in enumerate(s)}
    assert all(d < i for i, q in enumerate(s) for d in q.after)
    sub0, sub1 = ix["trace_0001/a1#0"], ix["trace_0001/a1#1"]
    assert s[sub0].after == (ix["trace_0001#0"],) and s[sub0].gap_s == pytest.approx(4.0)  # 5 - 0 - api 1
    assert s[ix["trace_0001#1"]].after == tuple(sorted((ix["trace_0001#0"], sub1)))  # waits for the subagent
    assert s[ix["trace_0001#2"]].gap_s == 4.0  # think_time
    # one user: the second conversation waits for the end of the first
    assert s[ix["trace_0002#0"]].after == (ix["trace_0001#3"],)
    two = build_schedule(tr, ReplayOptions(users=2), V)
    assert next(q for q in two if q.id == "trace_0002#0").after == ()
    # collapse_pairs drops the second of the equal-hash s/n pair
    assert len(build_schedule(tr, ReplayOptions(users=1, collapse_pairs=True), V)) == len(s) - 2


def test_open_loop_keeps_t_and_poisson_session_starts(tmp_path):
    tr = read_trace(write_cc(tmp_path / "cc", [conversation(f"trace_000{i}") for i in range(1, 6)]))
    s = build_schedule(tr, ReplayOptions(session_rate=0.1, seed=3), V)
    starts = {q.session: q.arrival_s for q in s if q.id.endswith("#0") and "/" not in q.session}
    assert starts["trace_0001"] == 0.0 and len(set(starts.values())) == 5
    for q in s:
        if q.id == "trace_0001#1":
            assert q.arrival_s == 20.0
        if q.id == "trace_0001/a1#1":
            assert q.arrival_s == 7.0  # subagent start 5 + its t 2
        assert q.after == ()
    assert [q.arrival_s for q in s] == sorted(q.arrival_s for q in s)
    again = build_schedule(tr, ReplayOptions(session_rate=0.1, seed=3), V)
    assert [(q.id, q.arrival_s) for q in again] == [(q.id, q.arrival_s) for q in s]


def test_simulator_and_live_replay_see_the_same_requests(tmp_path):
    """One file → the same request sequence, arrivals, dependencies and lengths in both."""
    d = write_cc(tmp_path / "cc", [conversation(f"trace_000{i}") for i in range(1, 4)])
    for opts in (ReplayOptions(session_rate=0.2, tokens_per_block=16), ReplayOptions(users=2, tokens_per_block=16)):
        live = build_schedule(read_trace(d), opts, V)  # what cpd bench sends
        sim = trace_workload(read_trace(d), opts, sim_block_tokens=16)
        assert [(q.arrival_s, q.prompt_len, q.max_tokens, q.kind, q.after or -1, q.gap_s) for q in live] == \
            [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.tag, r.after, r.think_s) for r in sim]
        assert [tuple(q.hash_ids) for q in live] == [r.blocks for r in sim]
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": [0, i]})
                         + "\n" for i, t in enumerate([0, 0, 0, 3000, 3000, 7000])))
    opts = ReplayOptions(spread_ticks=True, time_scale=2.0)
    live = build_schedule(read_trace(m), opts, V)
    sim = trace_workload(read_trace(m), opts)
    assert [q.arrival_s for q in live] == [r.arrival_s for r in sim] == pytest.approx([0, .5, 1, 1.5, 2.25, 3.5])


def test_sim_blocks_regroup_by_last_key():
    class Q:
        hash_ids = [1, 2, 3, 4, 5]
    assert sim_blocks(Q, 64, 128) == (2, 4, 5)
    assert sim_blocks(Q, 64, 64) == (1, 2, 3, 4, 5)
    with pytest.raises(ValueError):
        sim_blocks(Q, 64, 100)


def test_azure_csv_has_no_prefix_unless_modelled(tmp_path):
    p = tmp_path / "az.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,1100,10\n"
                 "2023-11-16 18:17:04.4799600,700,5\n")
    assert detect_format(p) == "azure"
    tr = read_trace(p)
    assert not tr.has_prefix_info and tr.timed
    s = build_schedule(tr, ReplayOptions(), V)
    assert [q.arrival_s for q in s] == pytest.approx([0.0, 0.5]) and all(q.reuse == 0 for q in s)
    assert s[0].block_lens == [512, 512, 76]
    m = build_schedule(tr, ReplayOptions(azure_prefix_tokens=512), V)
    assert m[1].cached_trace_tokens == 512 and m[0].hash_ids[0] == m[1].hash_ids[0]


@pytest.mark.parametrize("name,content,where", [
    ("bad.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\nnot json\n', ":2"),
    ("bad2.jsonl", '{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2]}\n', ":1"),
    ("bad3.jsonl", '{"timestamp": "x", "input_length": 20, "output_length": 1, "hash_ids": [1]}\n', ":1"),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,abc,1\n", ":2"),
    ("weird.txt", "hello,world\n", ":1"),
    ("trace_0009.json", '{"id": "x", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": 10}]}', "requests[0]"),
    ("trace_0008.json", '{"id": "x", "block_size": 64, "requests": [{"t": 0, "type": "n", "in": 200, "out": 1, '
                        '"hash_ids": [1]}]}', "requests[0].hash_ids"),
    ("trace_0007.json", '{"id": "x", "block_size": 64, "requests": [\n{"t": 0,', ":2"),
])
def test_malformed_input_is_a_clear_error(tmp_path, name, content, where):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(TraceFormatError) as e:
        read_trace(p)
    msg = str(e.value)
    assert str(p) in msg and where in msg and "expected" in msg


def test_truncated_gzip_and_missing_folder_are_clear_errors(tmp_path):
    d = tmp_path / "cc"
    d.mkdir()
    blob = gzip.compress(json.dumps(conversation()).encode())
    (d / "trace_0001.json.gz").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(TraceFormatError, match="trace_0001.json.gz: expected a complete gzip file"):
        read_trace(d)
    with pytest.raises(TraceFormatError, match="no such path"):
        read_trace(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceFormatError, match="trace_"):
        read_trace(empty)


def test_options_that_do_not_fit_the_trace(tmp_path):
    tr = read_trace(write_cc(tmp_path / "cc", [conversation()]))
    with pytest.raises(ValueError, match="exactly one arrival model"):
        build_schedule(tr, ReplayOptions(), V)
    m = tmp_path / "m.jsonl"
    m.write_text('{"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="no sessions"):
        build_schedule(read_trace(m), ReplayOptions(users=2), V)


def test_max_requests_caps_each_session_and_drops_later_subagents(tmp_path):
    """For traces of sessions, ``max_requests`` keeps each session's first N requests; a subagent
    that follows a dropped request is dropped, one that follows a kept request is kept whole."""
    from cpd.traces import ReplayOptions, Vocab, build_schedule, read_trace
    early = conversation("trace_0001")  # its subagent starts at 5 s, after request 0
    late = conversation("trace_0002")
    r = late["requests"]
    r[1]["t"] = 25.0  # this subagent starts after request 1 (t = 20 s)
    late["requests"] = [r[0], r[2], r[1], r[3], r[4]]
    tr = read_trace(write_cc(tmp_path / "cc", [early, late]))
    assert [a.after_index for s in tr.sessions for a in s.subagents] == [0, 1]

    def n(cap):
        return len(build_schedule(tr, ReplayOptions(users=1, max_requests=cap), Vocab(1000)))
    assert n(None) == 2 * (4 + 2)
    assert n(1) == (1 + 2) + 1  # early keeps its subagent, late drops it
    assert n(2) == (2 + 2) + (2 + 2)
