"""The typed router↔worker contract (cpd.messages): messages round-trip through their JSON
encoding, and real worker processes refuse malformed bodies with 400 naming the field, answer in
the typed shapes the router decodes, and the router's records carry the typed decision."""
from __future__ import annotations

import httpx
import msgspec
import pytest
from deploy_util import assert_no_leaks, oracle_tokens, random_prompt, start

from cpd.messages.handoff import HandoffHandle, HandoffRelease
from cpd.messages.sampling import SamplingParams
from cpd.messages.worker_api import (AppendRequest, DecodeLine, DecodeRequest, KvSnapshot, LoadReport,
                                     MalformedBody, PrefillRequest, PrefillResponse, RoleChangeRequest,
                                     RoleChangeResponse,
                                     WorkerInfoReport, decode_body, encode)
from cpd.types import Role, Tier

JSON = {"content-type": "application/json"}
HANDLE = HandoffHandle(kind="shm", host="127.0.0.1", port=1, request_id="r", nbytes=8, dtype="<f4", shape=(2,),
                       host_id="h/b", generation=7, checksum=9, reclaim_after_s=120.0, name="/proc/1/fd/3",
                       arena_id="a" * 32, offset=4160, release_url="http://127.0.0.1:2/handoff/release")


def test_messages_round_trip_through_json():
    s = SamplingParams(temperature=0.5, top_p=0.9, top_k=3, seed=2 ** 64 - 1, max_tokens=4, stop_token_ids=(5,))
    for msg, typ in [(PrefillRequest(request_id="r", prompt_token_ids=[1, 2], sampling=s, max_l3_blocks=0), PrefillRequest),
                     (DecodeRequest(request_id="r", token_ids=[1, 2, 3], sampling=s, handoff=HANDLE), DecodeRequest),
                     (HANDLE, HandoffHandle), (HandoffRelease("r", 7), HandoffRelease),
                     (DecodeLine([4], "stop"), DecodeLine),
                     (DecodeLine([4], num_cached_tokens_by_tier={Tier.L1: 32}, queue_s=0.5), DecodeLine),
                     (AppendRequest(request_id="r", prompt_token_ids=[1, 2], sampling=s), AppendRequest),
                     (RoleChangeRequest(Role.PREFILL), RoleChangeRequest),
                     (RoleChangeResponse("p0", Role.PRE_PREFILL, Role.PREFILL), RoleChangeResponse)]:
        assert decode_body(encode(msg), typ) == msg
    assert encode(DecodeLine([1])) == b'{"token_ids":[1]}'  # defaults stay off the wire


@pytest.mark.parametrize("body, field", [
    (b'{"request_id": "r", "prompt_token_ids": [1], "sampling": {"top_p": 0}}', "top_p must be in (0, 1]"),
    (b'{"request_id": "r", "prompt_token_ids": ["x"], "sampling": {}}', "$.prompt_token_ids[0]"),
    (b'{"request_id": "r", "prompt_token_ids": [1], "sampling": {"max_tokens": true}}', "$.sampling.max_tokens"),
    (b'{"prompt_token_ids": [1], "sampling": {}}', "request_id"),
    (b'not json', "malformed"),
])
def test_malformed_bodies_are_named(body, field):
    with pytest.raises(MalformedBody) as e:
        decode_body(body, PrefillRequest)
    assert field in str(e.value) and str(e.value).startswith("PrefillRequest")


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1)
    yield d
    d.stop()


def _worker(dep, role: str) -> dict:
    return next(w for w in dep.workers if w["role"] == role)


@pytest.mark.parametrize("path, body, names", [
    ("/prefill", {"request_id": "r", "prompt_token_ids": [1, 2], "sampling": {"temperature": -1}},
     "temperature must be >= 0"),
    ("/prefill", {"request_id": "r", "prompt_token_ids": "1 2", "sampling": {}}, "$.prompt_token_ids"),
    ("/prefill", {"request_id": 5, "prompt_token_ids": [1], "sampling": {}}, "$.request_id"),
    ("/decode", {"request_id": "r", "token_ids": [1], "sampling": {}, "handoff": {"kind": "disk"}}, "$.handoff.kind"),
    ("/decode", {"request_id": "r", "token_ids": [1], "sampling": {}}, "handoff"),
    ("/handoff/release", {"generation": 3}, "request_id"),
    ("/append", {"request_id": "r", "prompt_token_ids": [1], "sampling": {"top_k": "x"}}, "$.sampling.top_k"),
    ("/role", {"role": "teacher"}, "$.role"),
])
def test_live_worker_refuses_malformed_bodies_with_400(dep, path, body, names):
    role = "decode" if path in ("/decode", "/append") else "prefill"
    r = httpx.post(_worker(dep, role)["url"] + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert names in r.json()["error"], r.json()
    assert_no_leaks(dep)


def test_live_answers_decode_into_the_typed_messages(dep):
    p, d = _worker(dep, "prefill"), _worker(dep, "decode")
    info = decode_body(httpx.get(p["url"] + "/info", timeout=10).content, WorkerInfoReport)
    assert info.role is Role.PREFILL and info.worker_id == p["worker_id"] and info.max_model_len > 0
    body = {"model": dep.model_name, "prompt": random_prompt(801, 70), "max_tokens": 5, "temperature": 0,
            "ignore_eos": True}
    assert httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120).status_code == 200
    load = decode_body(httpx.get(p["url"] + "/load", timeout=10).content, LoadReport)
    assert load.role is Role.PREFILL and load.health.healthy and load.handoff["staged_shm"] >= 1
    assert decode_body(httpx.get(d["url"] + "/load", timeout=10).content, LoadReport).handoff is None
    snap = decode_body(httpx.get(p["url"] + "/kv_snapshot", timeout=10).content, KvSnapshot)
    assert len(snap.l1) >= 70 // 16  # the prompt's full blocks stay cached in L1
    rec = list(httpx.get(f"{dep.url}/cpd/requests", timeout=10).json().values())[-1]
    assert rec["class"] == "cold" and rec["pool"] == "prefill" and rec["reasons"][0].startswith("cold:reuse=")
    assert set(rec["cached_tokens_by_tier"]) <= {str(t) for t in Tier}
    assert rec["reason"] == "static" and [c["worker_id"] for c in rec["candidates"]] == [p["worker_id"]]
    assert_no_leaks(dep)


def test_live_prefill_answer_does_not_echo_the_prompt(dep):
    """The prefill worker's answer carries no copy of the prompt (``token_ids`` was 0.7 MB at 128K
    tokens, and nobody read it): the staged sequence is the prompt + ``first_token_ids``, and
    ``/decode`` continues it to the tokens the model gives."""
    p, d = _worker(dep, "prefill"), _worker(dep, "decode")
    prompt, sampling = random_prompt(803, 70), SamplingParams(max_tokens=4, ignore_eos=True)
    r = httpx.post(p["url"] + "/prefill", content=encode(PrefillRequest(
        request_id="echo-1", prompt_token_ids=prompt, sampling=sampling)), headers=JSON, timeout=60)
    assert r.status_code == 200, r.text
    assert "token_ids" not in r.json()  # first_token_ids only
    ans = decode_body(r.content, PrefillResponse)
    assert ans.handoff is not None and len(ans.first_token_ids) == 1
    tokens = list(ans.first_token_ids)
    body = DecodeRequest(request_id="echo-1", token_ids=prompt + tokens, sampling=sampling, handoff=ans.handoff)
    with httpx.stream("POST", d["url"] + "/decode", content=encode(body), headers=JSON, timeout=60) as s:
        for line in s.iter_lines():
            msg = decode_body(line.encode(), DecodeLine) if line else None
            if msg is not None and not msg.is_heartbeat:
                tokens += msg.token_ids
                if msg.finish_reason is not None:
                    break
    assert tokens == oracle_tokens(dep.model_dir, prompt, 4)
    assert_no_leaks(dep)


def test_live_role_change_is_typed_and_limited_to_prefill_side(dep):
    """POST /role: prefill <-> pre-prefill answers a RoleChangeResponse and /info reports it; a
    decode worker refuses with 409 (it has no handoff sender nor L3 connector)."""
    p, d = _worker(dep, "prefill"), _worker(dep, "decode")
    try:
        r = httpx.post(p["url"] + "/role", content=encode(RoleChangeRequest(Role.PRE_PREFILL)), timeout=10)
        assert decode_body(r.content, RoleChangeResponse) == RoleChangeResponse(p["worker_id"], Role.PREFILL,
                                                                                Role.PRE_PREFILL)
        assert decode_body(httpx.get(p["url"] + "/info", timeout=10).content, WorkerInfoReport).role is Role.PRE_PREFILL
    finally:
        httpx.post(p["url"] + "/role", content=encode(RoleChangeRequest(Role.PREFILL)), timeout=10)
    r = httpx.post(d["url"] + "/role", content=encode(RoleChangeRequest(Role.PREFILL)), timeout=10)
    assert r.status_code == 409 and r.json()["code"] == "role_change_refused"
