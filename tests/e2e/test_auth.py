"""Authentication and tenant isolation (issue 12 §3–4).

Pure parts (signatures, key files, salts) are checked directly; the rest against a live
deployment (real processes, HTTP, TCP handoff) started with two API keys of two tenants and an
internal shared secret.
"""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from cpd.auth import SignedAuth, handoff_proof, load_secret, sign, signed_headers, verify
from cpd.kv.block_hash import Namespace, hash_blocks
from cpd.router.api_keys import ApiKeys, effective_cache_salt, parse_key_file, tenant_of_key
from deploy_util import oracle_tokens, random_prompt, start

SECRET = "s3cret-for-tests"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


# ---- pure parts --------------------------------------------------------------------------------
def test_signature_binds_method_path_body_and_time():
    s = b"k"
    ts = 1_700_000_000
    sig = sign(s, "POST", "/prefill", b"{}", ts)
    assert verify(s, "POST", "/prefill", b"{}", str(ts), sig, ts + 10) is None
    for args in (("GET", "/prefill", b"{}"), ("POST", "/decode", b"{}"), ("POST", "/prefill", b"{ }")):
        assert verify(s, *args, str(ts), sig, ts)[0] == 403
    assert verify(b"other", "POST", "/prefill", b"{}", str(ts), sig, ts)[0] == 403
    assert verify(s, "POST", "/prefill", b"{}", str(ts), sig, ts + 301)[0] == 403  # replay window
    assert verify(s, "POST", "/prefill", b"{}", None, None, ts)[0] == 401
    h = signed_headers(s, "post", "/x", b"b", now_s=ts)
    assert verify(s, "POST", "/x", b"b", h["x-cpd-timestamp"], h["x-cpd-signature"], ts) is None


def test_secret_sources(tmp_path):
    f = tmp_path / "secret"
    f.write_text("  abc  \nignored\n")
    assert load_secret(str(f)) == b"abc"
    assert load_secret(None, env={"CPD_INTERNAL_SECRET": "xyz"}) == b"xyz"
    assert load_secret(None, env={}) is None
    with pytest.raises(ValueError, match="empty"):
        load_secret(None, env={"CPD_INTERNAL_SECRET": " "})


def test_key_file_and_tenants(tmp_path):
    assert parse_key_file("# c\n\nk1 alice\nk2\n") == [("k1", "alice"), ("k2", None)]
    with pytest.raises(ValueError, match="keys:3"):
        parse_key_file("a\nb\nc d e\n", "keys")
    f = tmp_path / "keys"
    f.write_text("k1 alice\nk2\n")
    keys = ApiKeys.build(["k3"], [str(f)])
    assert keys.tenant("k1") == "alice" and keys.tenant("k2") == tenant_of_key("k2")
    assert keys.tenant("k3") == tenant_of_key("k3") and keys.tenant("nope") is None
    assert "k2" not in tenant_of_key("k2")


def test_body_salt_only_narrows_the_tenant():
    salts = {effective_cache_salt(t, b) for t in ("alice", "bob") for b in (None, "x", "alice", "bob")}
    assert len(salts) == 8  # every (tenant, body salt) pair is its own namespace
    assert effective_cache_salt("bob", effective_cache_salt("alice", None)) != effective_cache_salt("alice", None)
    assert effective_cache_salt(None, "x") == "x"  # no keys configured: the body salt as before


# ---- live deployment ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dep(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    (tmp / "keys").write_text(f"{ALICE} alice\n{BOB} bob\n")
    # float32: alice's second request is warm (computes only the prompt's last block, in calls of
    # other shapes than the lone engine's prefill); in the ordinary mode only float32 keeps the
    # tokens then (bf16 may flip one: docs/architecture.md, correctness oracle)
    d = start(tiny_model_dir, "cpd", api_key_files=[str(tmp / "keys")], internal_secret=SECRET,
              handoff_force_tcp=True, settings={"engine.dtype": "float32"})
    yield d
    d.stop()


def _post(dep, key, prompt, **extra):
    body = {"model": dep.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{dep.url}/v1/completions", json=body, headers=headers, timeout=120)


def _signed():
    return SignedAuth(SECRET.encode())


def test_missing_or_wrong_api_key_is_401_with_openai_body(dep):
    prompt = random_prompt(1, 20)
    for key, headers in ((None, {}), ("sk-wrong", {}), (None, {"Authorization": "Basic abc"})):
        body = {"model": dep.model_name, "prompt": prompt, "max_tokens": 2}
        h = headers or ({"Authorization": f"Bearer {key}"} if key else {})
        r = httpx.post(f"{dep.url}/v1/completions", json=body, headers=h, timeout=30)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["message"]
    for path in ("/v1/models", "/cpd/requests", "/cpd/workers", "/openapi.json"):
        assert httpx.get(dep.url + path, timeout=10).status_code == 401, path
    assert httpx.get(dep.url + "/v1/models", headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
    assert httpx.get(dep.url + "/health", timeout=10).status_code == 200  # open by default
    assert httpx.get(dep.url + "/metrics", timeout=10).status_code == 200
    assert _post(dep, ALICE, prompt).status_code == 200


def test_worker_endpoints_need_the_shared_secret(dep):
    for w in dep.workers:
        url = w["url"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # probes stay open
        for method, path, body in (("GET", "/load", None), ("GET", "/info", None), ("GET", "/kv_snapshot", None),
                                   ("POST", "/reset_prefix_cache", {}), ("POST", "/prefill", {"request_id": "x"}),
                                   ("POST", "/decode", {"request_id": "x"}), ("POST", "/handoff/release",
                                                                              {"request_id": "x"})):
            r = httpx.request(method, url + path, json=body, timeout=10)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "missing_signature"
            r = httpx.request(method, url + path, json=body, auth=SignedAuth(b"wrong"), timeout=10)
            assert r.status_code == 403, (path, r.text)
        assert httpx.get(url + "/info", auth=_signed(), timeout=10).status_code == 200
        # a captured signature does not authorise another body
        h = signed_headers(SECRET.encode(), "POST", "/prefill", b'{"request_id":"a"}')
        r = httpx.post(url + "/prefill", content=b'{"request_id":"b"}', headers=h, timeout=10)
        assert r.status_code == 403


def test_tcp_handoff_refuses_a_connection_without_the_secret(dep):
    sender = next(w for w in dep.workers if w["role"] == "pre-prefill")
    # a real request: the decode worker fetched over TCP (force_tcp) and passed the challenge
    prompt = random_prompt(3, 40)
    r = _post(dep, ALICE, prompt, max_tokens=6)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens(dep.model_dir, prompt, 6, dtype="float32")
    load = httpx.get(sender["url"] + "/load", auth=_signed(), timeout=10).json()
    assert load["handoff"]["tcp_served"] >= 1
    port = load["handoff"]["tcp_port"]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        nonce = _recv(s, 16)
        s.sendall(handoff_proof(b"wrong", nonce))
        try:
            s.sendall(b"\0" * 12)
            got = s.recv(1)
        except ConnectionResetError:
            got = b""
        assert got == b""  # closed (or reset) without serving anything
    deadline = time.time() + 5
    while time.time() < deadline:
        load = httpx.get(sender["url"] + "/load", auth=_signed(), timeout=10).json()
        if load["handoff"].get("tcp_refused", 0) >= 1:
            break
        time.sleep(0.1)
    assert load["handoff"]["tcp_refused"] >= 1


def _recv(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return buf


def _cached(resp) -> int:
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _record(dep, key, rid):
    return httpx.get(f"{dep.url}/cpd/requests", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()[rid]


def _hashes(dep, prompt, tenant, body_salt=None):
    ns = Namespace(**dep.workers[0]["namespace"]).with_salt(effective_cache_salt(tenant, body_salt))
    return set(hash_blocks(prompt, ns))


def _held_blocks(dep) -> set[int]:
    """Every block hash any worker holds in L1 or L2, plus every L3 chunk's last hash."""
    from cpd.store import open_store
    held = set()
    for w in dep.workers:
        snap = httpx.get(w["url"] + "/kv_snapshot", auth=_signed(), timeout=10).json()
        held |= set(snap["l1"]) | set(snap["l2"])
    held |= {h for h, _ in open_store(dep.kv_store).list_visible()}
    return held


def test_tenants_never_share_kv_and_a_body_salt_cannot_cross(dep):
    prompt = random_prompt(7, 96)  # 6 full blocks
    oracle = oracle_tokens(dep.model_dir, prompt, 4, dtype="float32")
    a1 = _post(dep, ALICE, prompt)
    assert a1.status_code == 200 and _cached(a1) == 0
    alice_blocks = _hashes(dep, prompt, "alice")
    assert alice_blocks & _held_blocks(dep), "alice's blocks should be cached somewhere"
    # bob, same prompt, with no salt, with alice's name and with alice's encoded salt: all cold
    for salt in (None, "alice", effective_cache_salt("alice", None)):
        extra = {"cache_salt": salt} if salt else {}
        b = _post(dep, BOB, prompt, **extra)
        assert b.status_code == 200, b.text
        assert _cached(b) == 0, salt
        rec = _record(dep, BOB, b.json()["id"])
        assert not any(rec["cached_tokens_by_tier"].values()), rec
        assert b.json()["choices"][0]["token_ids"] == oracle
        bob_blocks = _hashes(dep, prompt, "bob", salt)
        held = _held_blocks(dep)
        assert bob_blocks & held and not bob_blocks & alice_blocks
    # positive control: alice again hits her own cache
    a2 = _post(dep, ALICE, prompt)
    assert _cached(a2) > 0 and a2.json()["choices"][0]["token_ids"] == oracle
    assert_no_leaks_signed(dep)
    # the routing records (prompt lengths, cache hits) are each tenant's own
    seen = {key: httpx.get(f"{dep.url}/cpd/requests", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
            for key in (ALICE, BOB)}
    assert a1.json()["id"] in seen[ALICE] and a2.json()["id"] in seen[ALICE]
    assert b.json()["id"] in seen[BOB] and not set(seen[ALICE]) & set(seen[BOB])


def assert_no_leaks_signed(dep):
    deadline = time.time() + 10
    while time.time() < deadline:
        pools = dep.pool_stats()
        if all(p["num_in_use"] == 0 for p in pools.values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"blocks in use: {pools}")


def test_index_match_sees_the_callers_namespace_only(dep):
    """``POST /cpd/index/match`` hashes the prompt in the caller's tenant namespace: alice sees
    her cached prompt, bob (same tokens, any body salt) sees nothing, no key is a 401."""
    prompt = random_prompt(8, 96)
    assert _post(dep, ALICE, prompt).status_code == 200

    def match(key, salt=None):
        r = httpx.post(f"{dep.url}/cpd/index/match", json={"prompt_token_ids": prompt, "cache_salt": salt},
                       headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
        return r

    deadline = time.time() + 15
    while time.time() < deadline and not match(ALICE).json()["l1"]:
        time.sleep(0.05)
    seen = match(ALICE).json()
    assert seen["num_blocks"] == 6 and max(seen["l1"].values()) >= 5, seen
    for salt in (None, "alice", effective_cache_salt("alice", None)):
        other = match(BOB, salt).json()
        assert not other["l1"] and not other["l2"] and other["l3"] == 0 and not other["l3_after"], (salt, other)
    assert match(None).status_code == 401
