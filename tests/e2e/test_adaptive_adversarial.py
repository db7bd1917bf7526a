"""Adversarial trials of adaptive routing's live paths (issue 11 §3-§6 under the failure classes of
issue 7): real worker processes of the small model, real HTTP, the official ``openai`` client,
real SIGSTOP / SIGKILL, a supervised deployment (killed processes come back).

One deployment for the module: topology cpd (1 pre-prefill, 1 prefill, 2 decode), float32 (the
decode-local append oracle holds in float32 only: docs/architecture.md), adaptive routing,
write-through all, decode-local append on, read-after-write on (pending writes predicted visible
at their prefill's predicted end), two API keys (tenants), the internal secret, short dispatch
bounds. Every request is short work (``heavy_uncached_s`` huge): it goes home to the prefill
worker ``p0`` unless the pre-prefill worker beats it, which makes each trial's routing
predictable. The read-after-write trial runs first, while the router's cost model still has its
initial prefill rate (so the writer's predicted end is far enough ahead for a follower to be held).

Classes: never a wrong token (tenants, an append whose worker stops or dies before its first
token, a role change in the middle of a request), never a hang (an append whose worker stops
after its first token, a read-after-write hold whose writer dies), hostile bodies get a clear 4xx,
a role changed at run time survives a worker and a router restart, nothing leaks (block pools,
stagings, pending writes).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from cpd.auth import client_auth
from deploy_util import assert_no_leaks, oracle_tokens, random_prompt, start

SECRET = "adaptive-adversarial-secret"
KEY_A, KEY_B = "tenant-a-key-0001", "tenant-b-key-0002"
# Router bounds (CPD_DISPATCH_TIMEOUTS): a prefill's headers <= 2 + 4 s, then <= 4 s between its
# progress lines (sent every 0.5 s); an append's first token <= 4 s + 4 x estimate; decode/append
# headers <= 5 s; <= 3 s between NDJSON lines (heartbeats every 0.5 s).
TIMEOUTS = {"connect_s": 2.0, "prefill_idle_s": 4.0, "prefill_floor_s": 4.0, "prefill_slack": 4.0,
            "decode_floor_s": 5.0, "decode_idle_s": 3.0}
SLACK_S = 20.0  # the rest of a request on a loaded 2-core machine


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "cpd", num_prefill=1, num_decode=2, internal_secret=SECRET, supervise=True,
              restart_backoff_s=0.5, extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps(TIMEOUTS)},
              settings={"engine.dtype": "float32", "router.routing_mode": "adaptive", "router.write_through": "all",
                        "router.tpot_slo_s": 0.5, "router.decode_append_max_tokens": 64,
                        "router.heavy_uncached_s": 100.0, "router.raw_wait_max_s": 3.0,
                        "router.raw_ready_margin_s": 0.0, "auth.api_keys": [KEY_A, KEY_B]})
    yield d
    for w in d.workers:
        _signal(d, w["worker_id"], signal.SIGCONT)
    d.stop()


@pytest.fixture(autouse=True)
def _healthy_before_and_clean_after(dep):
    dep.wait_ready(120)
    yield
    for w in dep.workers:
        _signal(dep, w["worker_id"], signal.SIGCONT)
    dep.wait_ready(120)
    assert_no_leaks(dep)
    deadline = time.time() + 10  # pending L3 writes: forgotten when visible, failed or expired
    while time.time() < deadline and _get(dep, "/cpd/index")["pending_writes"]:
        time.sleep(0.2)
    assert _get(dep, "/cpd/index")["pending_writes"] == 0
    busy = {k: (w["queued_prefill_tokens"], w["running_requests"], w["pending_handoffs"])
            for k, w in _get(dep, "/cpd/workers").items()
            if w["queued_prefill_tokens"] or w["running_requests"] or w["pending_handoffs"]}
    assert not busy, f"router-side queue figures not back to zero: {busy}"


def _signal(dep, worker_id: str, sig) -> None:
    try:
        os.kill(dep.pids()[worker_id], sig)
    except (ProcessLookupError, KeyError):
        pass


def _get(dep, path: str, key: str = KEY_A):
    return httpx.get(f"{dep.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=5).json()


def _client(dep, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dep.url}/v1", api_key=key, max_retries=0, timeout=120)


def _complete(dep, prompt: list[int], max_tokens: int, key: str = KEY_A, **extra):
    """One greedy completion through the official client: (token ids, cached tokens, routing record)."""
    r = _client(dep, key).completions.create(model=dep.model_name, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True,
                                                                        **extra})
    raw = r.model_dump()
    cached = (raw["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return raw["choices"][0]["token_ids"], cached, _get(dep, "/cpd/requests", key)[r.id]  # its tenant's own records


def _conversation(dep, seed: int, key: str = KEY_A) -> tuple[list[int], str]:
    """Turn 1 of a conversation; returns turn 2's prompt (whose prefix sits in a decode worker's
    L1) and that decode worker."""
    turn1 = random_prompt(seed, 90)
    out, _, rec = _complete(dep, turn1, 12, key)
    dep.wait_indexed(turn1 + out, "L1", worker_id=rec["decode_worker"], api_key=key)  # its BlockStored events
    return turn1 + out + random_prompt(seed + 1, 8), rec["decode_worker"]


def _metric(dep, name: str, **labels: str) -> float:
    """A counter of the router's /metrics: the sample with exactly ``labels``, or (no labels) the
    sum over all its samples."""
    text = httpx.get(f"{dep.url}/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    heads = (f"{name}{{{want}}} ",) if want else (f"{name} ", f"{name}{{")
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(heads))


def test_read_after_write_hold_whose_writer_dies(dep, tiny_model_dir):
    """A long prompt goes to the (stopped) prefill worker, which announces its blocks as pending L3
    writes; a follower sharing that prefix is held for them (read-after-write: waiting is predicted
    faster than recomputing the prefix on the idle pre-prefill worker); the writer is then
    SIGKILLed. Both requests end with the oracle's tokens within the bounds, the follower is
    decided again on what is visible, and the pending writes are forgotten."""
    base = random_prompt(71, 1900)
    follower = base + random_prompt(72, 20)
    expected = (oracle_tokens(tiny_model_dir, base, 2, dtype="float32"),
                oracle_tokens(tiny_model_dir, follower, 4, dtype="float32"))
    waits_before = _metric(dep, "cpd_read_after_write_waits_total")
    out: dict = {}
    _signal(dep, "p0", signal.SIGSTOP)
    try:
        t_writer = threading.Thread(target=lambda: out.setdefault("writer", _complete(dep, base, 2)))
        t_writer.start()
        deadline = time.time() + 10
        while time.time() < deadline and not _get(dep, "/cpd/index")["pending_writes"]:
            time.sleep(0.05)
        assert _get(dep, "/cpd/index")["pending_writes"] == 1900 // 16
        t_follow = threading.Thread(target=lambda: out.setdefault("follower", _complete(dep, follower, 4)))
        t_follow.start()
        time.sleep(0.3)  # the follower is held now
    finally:
        t_kill = time.monotonic()
        dep.kill_worker("p0")
    t_writer.join(120)
    t_follow.join(120)
    elapsed = time.monotonic() - t_kill
    (w_tokens, _, w_rec), (f_tokens, _, f_rec) = out["writer"], out["follower"]
    print(f"writer retried on {w_rec['prefill_worker']}; follower held {f_rec['raw_wait_s']:.2f} s, "
          f"then {f_rec['reason']} on {f_rec['prefill_worker']}; both done {elapsed:.1f} s after the kill")
    assert (w_tokens, f_tokens) == expected
    assert w_rec["prefill_worker"] != "p0" and f_rec["prefill_worker"] != "p0"
    assert 0 < f_rec["raw_wait_s"] <= 3.0 + 0.5, f_rec
    assert f_rec["reason"] != "wait-for-l3", f_rec  # decided again on what is visible
    assert _metric(dep, "cpd_read_after_write_waits_total") == waits_before + 1
    assert elapsed < TIMEOUTS["prefill_idle_s"] + SLACK_S


def test_append_never_crosses_tenants_and_returns_oracle_tokens(dep, tiny_model_dir):
    """Tenant B (another API key) sending tenant A's turn 2 word for word, and tenant A narrowing
    with a body ``cache_salt``, never reuse A's decode-worker blocks; A's own turn 2 is appended
    there; all of them get the oracle's tokens."""
    turn2, holder = _conversation(dep, 21)
    expected = oracle_tokens(tiny_model_dir, turn2, 8, dtype="float32")
    for key, extra in ((KEY_B, {}), (KEY_A, {"cache_salt": "narrower"})):
        out, cached, rec = _complete(dep, turn2, 8, key, **extra)
        assert (rec["reason"], cached) != ("decode-append", 96) and cached == 0, rec
        assert not any(rec["cached_tokens_by_tier"].values()), rec
        assert out == expected
    out, cached, rec = _complete(dep, turn2, 8, KEY_A)
    assert (rec["reason"], rec["decode_worker"], cached) == ("decode-append", holder, 96), rec
    assert out == expected


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "sigkill"])
def test_append_whose_worker_fails_before_its_first_token_is_rerouted(dep, tiny_model_dir, sig):
    """The decode worker holding the prefix is stopped (or killed) before the append reaches it:
    the append fails within its bound (headers ≤ decode_floor_s) and the request is prefilled and
    decoded elsewhere, with the oracle's tokens."""
    turn2, holder = _conversation(dep, 31 if sig == signal.SIGSTOP else 41)
    expected = oracle_tokens(tiny_model_dir, turn2, 8, dtype="float32")
    before = _metric(dep, "cpd_decode_appends_total", outcome="fallback")
    _signal(dep, holder, sig)
    try:
        t0 = time.monotonic()
        out, _, rec = _complete(dep, turn2, 8)
        elapsed = time.monotonic() - t0
    finally:
        _signal(dep, holder, signal.SIGCONT)
    print(f"{signal.Signals(sig).name}: rerouted in {elapsed:.1f} s ({rec['reason']} on {rec['prefill_worker']})")
    assert out == expected
    assert rec["decode_worker"] != holder and rec["pool"] != "decode", rec
    assert elapsed < TIMEOUTS["connect_s"] + TIMEOUTS["decode_floor_s"] + SLACK_S
    assert _metric(dep, "cpd_decode_appends_total", outcome="fallback") == before + 1


def test_append_whose_worker_stops_after_its_first_token_ends_with_an_error_event(dep):
    """SIGSTOP of the appending decode worker mid-stream: the client gets its first tokens, then a
    final SSE error event within the idle bound, never a hang; the other tenant's request beside
    it is unaffected."""
    turn2, holder = _conversation(dep, 51)
    errors_before = _metric(dep, "cpd_decode_appends_total", outcome="error")
    body = {"model": dep.model_name, "prompt": turn2, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events: list[dict] = []
    t_stop = None
    with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY_A}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: "):]))
            if t_stop is None:
                _signal(dep, holder, signal.SIGSTOP)
                t_stop = time.monotonic()
    elapsed = time.monotonic() - t_stop
    _signal(dep, holder, signal.SIGCONT)
    rec = _get(dep, "/cpd/requests")[events[0]["id"]]
    assert rec["reason"] == "decode-append", rec
    assert "error" in events[-1] and "choices" in events[0], events[-1]
    assert elapsed < TIMEOUTS["decode_idle_s"] + SLACK_S, elapsed
    assert _metric(dep, "cpd_decode_appends_total", outcome="error") == errors_before + 1
    other, _, _ = _complete(dep, random_prompt(52, 40), 4, KEY_B)  # the deployment still serves
    assert len(other) == 4


def test_append_stopped_by_a_stop_string_or_left_by_its_client(dep):
    """An append that ends on a stop string counts as ``ok``, one whose client leaves mid-stream as
    ``cancelled``; both free their blocks on the decode worker (the autouse check)."""
    turn2, _ = _conversation(dep, 91)
    before = {o: _metric(dep, "cpd_decode_appends_total", outcome=o) for o in ("ok", "cancelled")}
    client = _client(dep)
    text = client.completions.create(model=dep.model_name, prompt=turn2, max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[10:14]
    r = client.completions.create(model=dep.model_name, prompt=turn2, max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert _get(dep, "/cpd/requests")[r.id]["reason"] == "decode-append"
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    stream = client.completions.create(model=dep.model_name, prompt=turn2, max_tokens=1500, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    first = next(iter(stream))
    stream.close()  # the client leaves after its first chunk
    assert _get(dep, "/cpd/requests")[first.id]["reason"] == "decode-append"
    assert text.startswith(first.choices[0].text)
    deadline = time.time() + 10
    while time.time() < deadline and _metric(dep, "cpd_decode_appends_total", outcome="cancelled") == before["cancelled"]:
        time.sleep(0.1)
    assert _metric(dep, "cpd_decode_appends_total", outcome="cancelled") == before["cancelled"] + 1
    assert _metric(dep, "cpd_decode_appends_total", outcome="ok") == before["ok"] + 2


def test_role_change_in_the_middle_of_a_request(dep, tiny_model_dir):
    """The prefill worker is stopped with a request on it, then moved to the pre-prefill role at
    the router: the request finishes with the oracle's tokens, the role change is counted once, and
    the change back leaves the deployment as it was."""
    prompt = random_prompt(61, 600)
    expected = oracle_tokens(tiny_model_dir, prompt, 6, dtype="float32")
    auth = dep.internal_client_auth()
    out: dict = {}
    _signal(dep, "p0", signal.SIGSTOP)
    th = threading.Thread(target=lambda: out.setdefault("r", _complete(dep, prompt, 6)))
    th.start()
    deadline = time.time() + 10
    while time.time() < deadline and not _get(dep, "/cpd/workers")["p0"]["running_requests"]:
        time.sleep(0.05)
    workers = _get(dep, "/cpd/workers")
    assert workers["p0"]["running_requests"] == 1
    # routing rule 6: the decode worker it will hand off to counts it while its prefill runs
    assert sum(w["pending_handoffs"] for w in workers.values() if w["role"] == "decode") == 1
    before = _metric(dep, "cpd_role_changes_total", from_role="prefill", to_role="pre-prefill")
    _signal(dep, "p0", signal.SIGCONT)
    r = httpx.post(f"{dep.url}/cpd/role", json={"worker_id": "p0", "role": "pre-prefill"}, auth=auth, timeout=10)
    assert r.status_code == 200, r.text
    th.join(120)
    tokens, _, rec = out["r"]
    assert tokens == expected and rec["prefill_worker"] == "p0", rec
    assert _metric(dep, "cpd_role_changes_total", from_role="prefill", to_role="pre-prefill") == before + 1
    r = httpx.post(f"{dep.url}/cpd/role", json={"worker_id": "p0", "role": "prefill"}, auth=auth, timeout=10)
    assert r.status_code == 200 and _get(dep, "/cpd/workers")["p0"]["role"] == "prefill"


def test_hostile_bodies_get_a_clear_4xx(dep):
    """Malformed, unsigned, wrongly signed or impossible requests to ``/append``, ``/role`` and
    ``/cpd/role`` are refused with a 4xx that says why; nothing changes."""
    auth, bad = dep.internal_client_auth(), client_auth(b"not the secret")
    url = {w["worker_id"]: w["url"] for w in dep.workers}
    append = {"request_id": "hostile-1", "prompt_token_ids": [11, 12, 13], "sampling": {"max_tokens": 2}}
    cases = [
        (f"{url['d0']}/append", b'{"request_id": "x"', auth, 400, "AppendRequest"),
        (f"{url['d0']}/append", json.dumps({**append, "prompt_token_ids": [-1]}).encode(), auth, 400, "token ids"),
        (f"{url['d0']}/append", json.dumps({**append, "prompt_token_ids": []}).encode(), auth, 400, "empty"),
        (f"{url['d0']}/append", json.dumps(append).encode(), None, 401, "signature"),
        (f"{url['d0']}/append", json.dumps(append).encode(), bad, 403, "signature"),
        (f"{url['p0']}/append", json.dumps(append).encode(), auth, 409, "only decode workers append"),
        (f"{url['p0']}/role", b'{"role": "boss"}', auth, 400, "$.role"),
        (f"{url['p0']}/role", b'["prefill"]', auth, 400, "object"),
        (f"{url['p0']}/role", b"[" * 50000 + b"]" * 50000, auth, 400, "RoleChangeRequest"),
        (f"{url['p0']}/role", b'{"role": "decode"}', auth, 409, "only pre-prefill <-> prefill"),
        (f"{url['d0']}/role", b'{"role": "prefill"}', auth, 409, "only pre-prefill <-> prefill"),
        (f"{url['p0']}/role", b'{"role": "pre-prefill"}', None, 401, "signature"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "pp0", "role": "prefill"}', None, 401, "signature"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "pp0", "role": "prefill"}', bad, 403, "signature"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "nobody", "role": "prefill"}', auth, 404, "unknown worker"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "pp0", "role": "boss"}', auth, 400, "$.role"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "pp0"}', auth, 400, "role"),
        (f"{dep.url}/cpd/role", b'{"worker_id": 7, "role": "prefill"}', auth, 400, "$.worker_id"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "\\ud800", "role": "prefill"}', auth, 400, "malformed"),
        (f"{dep.url}/cpd/role", b"\xff\xfe{", auth, 400, "malformed"),
        (f"{dep.url}/cpd/role", b"[" * 50000 + b"]" * 50000, auth, 400, "RoleAssignment"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "pp0", "role": "decode"}', auth, 409, "only pre-prefill"),
        (f"{dep.url}/cpd/role", b'{"worker_id": "d1", "role": "prefill"}', auth, 409, "only pre-prefill"),
    ]
    roles = {k: v["role"] for k, v in _get(dep, "/cpd/workers").items()}
    for target, body, how, status, says in cases:
        r = httpx.post(target, content=body, headers={"content-type": "application/json"}, auth=how, timeout=10)
        assert (r.status_code, says in r.text) == (status, True), (target, body[:60], r.status_code, r.text[:300])
    assert {k: v["role"] for k, v in _get(dep, "/cpd/workers").items()} == roles
    for w in dep.workers:
        assert httpx.get(f"{w['url']}/info", auth=auth, timeout=5).json()["role"] == w["role"]
    # the id of a request in flight, reused: 409, and the request in flight keeps its stream
    long = {**append, "request_id": "dup-1", "sampling": {"max_tokens": 300, "ignore_eos": True}}
    with httpx.stream("POST", f"{url['d1']}/append", json=long, auth=auth, timeout=60) as first:
        lines = first.iter_lines()
        assert json.loads(next(line for line in lines if line))["token_ids"]
        r = httpx.post(f"{url['d1']}/append", json=long, auth=auth, timeout=10)
        assert (r.status_code, r.json().get("code")) == (409, "duplicate_request_id"), r.text
        rest = [json.loads(line) for line in lines if line]
    assert rest[-1]["finish_reason"] == "length" and 1 + sum(len(x["token_ids"]) for x in rest) == 300


def _wait_role(dep, worker_id: str, role: str, timeout_s: float = 60.0) -> dict:
    deadline = time.time() + timeout_s
    w: dict = {}
    while time.time() < deadline:
        try:
            w = _get(dep, "/cpd/workers")[worker_id]
        except (httpx.HTTPError, ValueError):
            w = {}
        if w.get("role") == role and w.get("healthy") and w.get("state") == "accepted":
            return w
        time.sleep(0.2)
    raise AssertionError(f"{worker_id} not an accepted, healthy {role} worker: {w}")


def test_role_changed_at_run_time_survives_worker_and_router_restarts(dep, tiny_model_dir):
    """A role changed at run time disagrees with the command line (worker) and the config (router)
    after a restart: the restarted side's view is adopted, the worker is never refused."""
    auth = dep.internal_client_auth()
    # the worker restarts with its command-line role; the router adopts it
    r = httpx.post(f"{dep.url}/cpd/role", json={"worker_id": "pp0", "role": "prefill"}, auth=auth, timeout=10)
    assert r.status_code == 200, r.text
    dep.kill_worker("pp0")
    _wait_role(dep, "pp0", "pre-prefill")
    # the router restarts with its config's roles; the worker keeps the role it was given
    r = httpx.post(f"{dep.url}/cpd/role", json={"worker_id": "p0", "role": "pre-prefill"}, auth=auth, timeout=10)
    assert r.status_code == 200, r.text
    dep.kill_router()
    dep.wait_ready(120)
    w = _wait_role(dep, "p0", "pre-prefill")
    assert w["last_role_change"]["reason"] == "reported by the worker at admission", w
    prompt = random_prompt(81, 100)
    tokens, _, _ = _complete(dep, prompt, 4)
    assert tokens == oracle_tokens(tiny_model_dir, prompt, 4, dtype="float32")
    r = httpx.post(f"{dep.url}/cpd/role", json={"worker_id": "p0", "role": "prefill"}, auth=auth, timeout=10)
    assert r.status_code == 200 and _wait_role(dep, "p0", "prefill")
