"""Adversarial checks of the engine-thread handoff staging (cpd.worker.runtime.EngineRunner.stage_handoff,
cpd.worker.server._prefill_and_stage, 4b83705) and of the handler-first engine lock (HandlerFirstLock):
real router, real modeled worker processes, real HTTP (``pd`` 1 + 1, one module deployment; ~60 s).

- leaks: direct ``/prefill`` calls (plain and ``stream_progress``) whose client goes away at every
  moment around the first token (0.25-1.45 x the measured prefill time), beside a long prompt that
  keeps the engine stepping, and calls hung up right after sending; afterwards every pool is empty
  and no staging is left.
- staging that raises: a second prefill of a request id whose first staging is still held makes the
  engine thread's ``stage_into`` raise ("already staged"); that request fails, the others beside it
  get exact tokens, nothing is leaked.
- tokens: 16 concurrent requests with a shared prefix and different lengths through the router,
  against the modeled oracle, with a 64 KiB handoff arena (16 B/token here: some go over TCP).
- handlers vs the engine: /kv_snapshot and /reset_prefix_cache streams against busy workers are
  answered in bounded time while prefill and decode keep their pace.
- ``slow``: a supervised ``cpd`` deployment (3 s liveness timeout) under all of the above at once:
  exact tokens, no liveness restart, no leak.

Two tests failed before the fix that followed them (the bugs are older than 4b83705): a second prefill of a request id still
staged was answered with a bare 500 after the whole prefill, and its cleanup freed the other call's
staging of that id; a /prefill sent to a decode worker crashed on its missing sender. Both are now
refused up front with 409 and a code (``duplicate_request_id``, ``wrong_role``).
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from cpd.engine.engine import Engine, SamplingParams
from cpd.engine.executor_modeled import build_modeled_executor
from cpd.messages.handoff import HandoffRelease
from cpd.messages.sampling import SamplingParams as WireSampling
from cpd.messages.worker_api import PrefillRequest, PrefillResponse, decode_body, encode
from deploy_util import assert_no_leaks, complete, random_prompt, start, wait_pools_idle

SHAPE, GPU = "llama-3.1-8b", "b200"
DILATION = 20.0  # a 512-token modeled prefill step lasts ~0.2 s
ARENA_BYTES = 64 << 10  # small: most handoffs do not fit and go over TCP
MODELED = {"engine.executor": "modeled", "engine.hardware": GPU, "engine.model_shape": SHAPE, "engine.tp": 1,
           "engine.time_dilation": DILATION, "engine.num_blocks": 2048, "engine.max_prefill_chunk_tokens": 512,
           "engine.max_num_batched_tokens": 1024, "handoff.arena_bytes": ARENA_BYTES}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, settings=MODELED)
    yield d
    d.stop()


def _url(dep, role: str) -> str:
    return next(w["url"] for w in dep.workers if w["role"] == role)


def _oracle(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    eng = Engine(None, num_blocks=1024, executor=build_modeled_executor(SHAPE, GPU, 1, served_model_dir=model_dir))
    return eng.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _prefill_body(rid: str, prompt: list[int], stream: bool) -> bytes:
    return encode(PrefillRequest(request_id=rid, prompt_token_ids=prompt, stream_progress=stream,
                                 sampling=WireSampling(max_tokens=4, ignore_eos=True)))


def _release(dep, handle) -> None:
    r = httpx.post(handle.release_url, content=encode(HandoffRelease(handle.request_id, handle.generation)),
                   headers=JSON, timeout=10, auth=dep.internal_client_auth())
    r.raise_for_status()


def _background_long(dep, seed: int, n_chunks: int) -> threading.Thread:
    """A long prompt through the router: keeps the prefill engine stepping back to back."""
    t = threading.Thread(target=complete, args=(dep, random_prompt(seed, n_chunks * 512), 2), daemon=True)
    t.start()
    return t


def _staged(dep) -> int:
    r = httpx.get(f"{_url(dep, 'prefill')}/load", timeout=10, auth=dep.internal_client_auth())
    return r.json()["handoff"]["num_staged"]


def test_clients_gone_around_the_first_token_leak_nothing(dep):
    auth, url = dep.internal_client_auth(), _url(dep, "prefill")
    prompt = random_prompt(7, 600)  # two steps beside the long one
    # the reference: how long a prefill takes here, beside a long one
    bg = _background_long(dep, 8, 10)
    time.sleep(0.5)
    t0 = time.monotonic()
    r = httpx.post(f"{url}/prefill", content=_prefill_body("ref", prompt, False), headers=JSON, timeout=60, auth=auth)
    first_s = time.monotonic() - t0
    ans = decode_body(r.content, PrefillResponse)
    _release(dep, ans.handoff)
    print(f"reference prefill {first_s:.3f} s")
    outcomes = {"gone": 0, "answered": 0}
    i = 0
    for frac in [x / 20 for x in range(5, 31, 3)]:  # 0.25 .. 1.45 of the prefill's time
        for stream in (False, True):
            i += 1
            if not bg.is_alive():
                bg = _background_long(dep, 100 + i, 10)
                time.sleep(0.3)
            rid = f"gone-{i}"
            try:
                with httpx.stream("POST", f"{url}/prefill", content=_prefill_body(rid, prompt, stream), headers=JSON,
                                  timeout=httpx.Timeout(60, read=max(0.01, frac * first_s)), auth=auth) as r:
                    body = r.read()
                # answered in time: the KV is ours to release (as the decode side would)
                last = body.strip().split(b"\n")[-1]
                if stream:
                    handle = json.loads(last)["answer"]["handoff"]
                    _release_raw(dep, handle)
                else:
                    _release(dep, decode_body(body, PrefillResponse).handoff)
                outcomes["answered"] += 1
            except httpx.ReadTimeout:
                outcomes["gone"] += 1
    bg.join(120)
    print(outcomes)
    assert outcomes["gone"] >= 2 and outcomes["answered"] >= 2, outcomes  # both sides of the first token were hit
    wait_pools_idle(dep)
    deadline = time.monotonic() + 10
    while _staged(dep) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert_no_leaks(dep)


def _release_raw(dep, handle: dict) -> None:
    r = httpx.post(handle["release_url"], json={"request_id": handle["request_id"], "generation": handle["generation"]},
                   timeout=10, auth=dep.internal_client_auth())
    r.raise_for_status()


def test_a_staging_that_raises_fails_its_request_alone(dep, tiny_model_dir):
    auth, url = dep.internal_client_auth(), _url(dep, "prefill")
    prompt = random_prompt(21, 300)
    r = httpx.post(f"{url}/prefill", content=_prefill_body("dup", prompt, False), headers=JSON, timeout=60, auth=auth)
    first = decode_body(r.content, PrefillResponse)
    others: dict[int, list[int]] = {}
    prompts = {k: random_prompt(30 + k, 200 + 150 * k) for k in range(4)}

    def run(k):
        others[k] = complete(dep, prompts[k], 3)["choices"][0]["token_ids"]
    threads = [threading.Thread(target=run, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    # the same id again while its first staging is held: the engine thread's staging raises
    r2 = httpx.post(f"{url}/prefill", content=_prefill_body("dup", prompt, False), headers=JSON, timeout=60, auth=auth)
    for t in threads:
        t.join(120)
    print(r2.status_code, r2.text[:300])
    assert r2.status_code >= 400, r2.text
    for k, p in prompts.items():
        assert others[k] == _oracle(tiny_model_dir, p, 3), k
    _release(dep, first.handoff)  # a no-op if the failed call released it
    assert_no_leaks(dep)


def test_shared_prefix_burst_tokens_exact_with_tcp_fallback(dep, tiny_model_dir):
    prefix = random_prompt(40, 700)
    prompts = [prefix[: 100 + 37 * k] + random_prompt(50 + k, 1 + (k * 53) % 600) for k in range(16)]
    results: dict[int, list[int] | str] = {}

    def run(k):
        try:
            results[k] = complete(dep, prompts[k], 3 + k % 4)["choices"][0]["token_ids"]
        except AssertionError as e:
            results[k] = str(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for k, p in enumerate(prompts):
        assert results.get(k) == _oracle(tiny_model_dir, p, 3 + k % 4), (k, results.get(k))
    load = httpx.get(f"{_url(dep, 'prefill')}/load", timeout=10, auth=dep.internal_client_auth()).json()["handoff"]
    print(load)
    assert load["staged_tcp"] > 0  # the case under test: the arena was too small for some
    assert_no_leaks(dep)


def test_a_stream_of_handlers_is_answered_and_the_engine_progresses(dep, tiny_model_dir):
    auth = dep.internal_client_auth()
    purl, durl = _url(dep, "prefill"), _url(dep, "decode")

    # baseline: a long prompt's prefill alone
    t0 = time.monotonic()
    complete(dep, random_prompt(60, 12 * 512), 2)
    alone_s = time.monotonic() - t0
    waits: list[tuple[str, float]] = []
    stop = threading.Event()

    def hammer(path: str, method: str, base: str):
        while not stop.is_set():
            t = time.monotonic()
            r = httpx.request(method, f"{base}{path}", timeout=30, auth=auth)
            r.raise_for_status()
            waits.append((path, time.monotonic() - t))
    hs = [threading.Thread(target=hammer, args=a, daemon=True) for a in
          [("/kv_snapshot", "GET", purl)] * 3 + [("/reset_prefix_cache", "POST", purl), ("/kv_snapshot", "GET", durl)]]
    for h in hs:
        h.start()
    dec = threading.Thread(target=complete, args=(dep, random_prompt(61, 100), 40), daemon=True)
    dec.start()
    t0 = time.monotonic()
    out = complete(dep, random_prompt(62, 12 * 512), 2)
    busy_s = time.monotonic() - t0
    dec.join(120)
    stop.set()
    for h in hs:
        h.join(30)
    worst = max(s for _, s in waits)
    print(f"long prefill alone {alone_s:.2f} s, under {len(waits)} handler calls {busy_s:.2f} s; worst call {worst:.3f} s")
    assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, random_prompt(62, 12 * 512), 2)
    assert len(waits) > 50
    assert worst < 3.0, sorted(waits, key=lambda x: -x[1])[:5]
    assert busy_s < 2.5 * alone_s + 2.0, (alone_s, busy_s)
    assert_no_leaks(dep)


def _send_and_hang_up(url: str, body: bytes, auth) -> None:
    """Send one POST and close the connection at once, before any answer (raw socket)."""
    import socket
    from urllib.parse import urlsplit
    req = httpx.Request("POST", url, content=body, headers=JSON)
    if auth is not None:
        req = next(auth.auth_flow(req))
    u = urlsplit(url)
    head = [f"POST {u.path} HTTP/1.1", f"host: {u.netloc}", "connection: close"]
    head += [f"{k}: {v}" for k, v in req.headers.items() if k.lower() not in ("host", "connection")]
    s = socket.create_connection((u.hostname, u.port), timeout=5)
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    s.close()


def test_a_streamed_prefill_whose_client_hung_up_before_the_answer_began_leaks_nothing(dep):
    auth, url = dep.internal_client_auth(), _url(dep, "prefill")
    for i in range(5):
        _send_and_hang_up(f"{url}/prefill", _prefill_body(f"hangup-s-{i}", random_prompt(300 + i, 300), True), auth)
        _send_and_hang_up(f"{url}/prefill", _prefill_body(f"hangup-p-{i}", random_prompt(400 + i, 300), False), auth)
    time.sleep(2.0)  # every prefill has run to its first token by now
    print("staged after the hang-ups:", _staged(dep))
    assert_no_leaks(dep)


def test_many_concurrent_snapshots_do_not_stall_decoding(dep, tiny_model_dir):
    auth, durl = dep.internal_client_auth(), _url(dep, "decode")
    prompt, n = random_prompt(70, 64), 40
    t0 = time.monotonic()
    complete(dep, prompt, n)
    alone_s = time.monotonic() - t0
    stop, waits = threading.Event(), []

    def hammer():
        with httpx.Client(timeout=30, auth=auth) as c:
            while not stop.is_set():
                t = time.monotonic()
                c.get(f"{durl}/kv_snapshot").raise_for_status()
                waits.append(time.monotonic() - t)
    hs = [threading.Thread(target=hammer, daemon=True) for _ in range(12)]
    for h in hs:
        h.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    out = complete(dep, prompt, n)
    busy_s = time.monotonic() - t0
    stop.set()
    for h in hs:
        h.join(30)
    print(f"decode of {n} tokens alone {alone_s:.2f} s, beside {len(waits)} snapshots {busy_s:.2f} s, "
          f"worst snapshot {max(waits):.3f} s")
    assert out["choices"][0]["token_ids"] == _oracle(tiny_model_dir, prompt, n)
    assert busy_s < 3 * alone_s + 2.0, (alone_s, busy_s)
    assert_no_leaks(dep)


CPD_SETTINGS = {**MODELED, "engine.max_step_s": 2.0, "deployment.liveness_timeout_s": 3.0,
                "deployment.liveness_probe_interval_s": 0.5, "deployment.liveness_probe_timeout_s": 1.0,
                "deployment.liveness_startup_grace_s": 1.0}


@pytest.mark.slow  # its own supervised cpd deployment: ~40-90 s on a loaded 2-core machine
def test_cpd_supervised_under_mixed_load_exact_tokens_no_false_restart_no_leaks(tiny_model_dir):
    """cpd (pre-prefill + prefill + decode), supervised with a 3 s liveness timeout: a burst of
    shared-prefix requests, handlers hammering every worker, and prefills dropped around their first
    token. Every token exact, no worker restarted, nothing leaked."""
    d = start(tiny_model_dir, "cpd", num_prefill=1, num_decode=1, supervise=True, restart_backoff_s=0.5,
              internal_secret="adversarial-staging-secret", settings=CPD_SETTINGS)
    try:
        auth, pids = d.internal_client_auth(), d.pids()
        prefix = random_prompt(80, 1500)
        prompts = [prefix[: 200 + 97 * k] + random_prompt(90 + k, 1 + (k * 211) % 1500) for k in range(20)]
        results: dict[int, list[int] | str] = {}
        stop, waits, drop_outcomes = threading.Event(), [], []

        def run(k):
            try:
                results[k] = complete(d, prompts[k], 2 + k % 5)["choices"][0]["token_ids"]
            except AssertionError as e:
                results[k] = str(e)

        def hammer(url: str, path: str, method: str):
            with httpx.Client(timeout=30, auth=auth) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    c.request(method, f"{url}{path}").raise_for_status()
                    waits.append(time.monotonic() - t)
                    time.sleep(0.01)

        def drop(k):  # prefills whose client goes away around their first token
            prefill_side = [w for w in d.workers if w["role"] != "decode"]  # a decode worker refuses /prefill (409 wrong_role)
            url = prefill_side[k % len(prefill_side)]["url"]
            for j in range(6):
                try:
                    r = httpx.post(f"{url}/prefill", content=_prefill_body(f"drop-{k}-{j}", random_prompt(
                        500 + 10 * k + j, 700), bool(j % 2)), headers=JSON, timeout=httpx.Timeout(30, read=0.1 + 0.12 * j),
                        auth=auth)
                except httpx.ReadTimeout:
                    drop_outcomes.append("gone")
                    continue
                assert r.status_code == 200, r.text
                last = json.loads(r.content.strip().split(b"\n")[-1])  # answered in time: release as a decode would
                _release_raw(d, (last["answer"] if j % 2 else last)["handoff"])
                drop_outcomes.append("answered")
        hs = [threading.Thread(target=hammer, args=(w["url"], p, m), daemon=True) for w in d.workers
              if w["role"] != "decode" for p, m in (("/kv_snapshot", "GET"), ("/reset_prefix_cache", "POST"))]
        hs += [threading.Thread(target=hammer, args=(w["url"], "/kv_snapshot", "GET"), daemon=True) for w in d.workers
               if w["role"] == "decode"]
        runs = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
        drops = [threading.Thread(target=drop, args=(k,)) for k in range(3)]
        for t in hs + drops + runs:
            t.start()
        for t in runs + drops:
            t.join(240)
        stop.set()
        for h in hs:
            h.join(30)
        print(f"{len(waits)} handler calls, worst {max(waits):.3f} s; drops {drop_outcomes}")
        for k, p in enumerate(prompts):
            assert results.get(k) == _oracle(tiny_model_dir, p, 2 + k % 5), (k, results.get(k))
        assert max(waits) < 5.0
        assert d.pids() == pids, d.supervisor_status()
        assert all(not p.get("liveness_restarts") for p in d.supervisor_status()["processes"].values())
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(
                (httpx.get(f"{w['url']}/load", timeout=10, auth=auth).json().get("handoff") or {}).get("num_staged")
                for w in d.alive_workers()):
            time.sleep(0.3)
        leaked = _which_staged(d, [f"drop-{k}-{j}" for k in range(3) for j in range(6)])
        print("leaked stagings (worker, request id):", leaked)
        assert not leaked, leaked
        assert_no_leaks(d)
    finally:
        d.stop()


def _which_staged(d, rids: list[str]) -> list[tuple[str, str]]:
    """Which of ``rids`` still have a staging on some worker (found by releasing them one by one)."""
    auth, found = d.internal_client_auth(), []
    for w in d.alive_workers():
        def staged() -> int:
            return (httpx.get(f"{w['url']}/load", timeout=10, auth=auth).json().get("handoff") or {}).get("num_staged", 0)
        n = staged()
        for rid in rids:
            if not n:
                break
            httpx.post(f"{w['url']}/handoff/release", json={"request_id": rid}, timeout=10, auth=auth)
            if staged() < n:
                found.append((w["worker_id"], rid))
                n -= 1
    return found


def test_a_duplicate_staging_is_refused_clearly_and_leaves_the_held_staging_alone(dep):
    """A second prefill of a request id whose first staging is still held (its decode has not fetched
    it yet): the engine thread's ``stage_into`` raises ``ValueError("already staged")``. Expected: a
    clear error for that call, and the first call's staging untouched."""
    auth, url = dep.internal_client_auth(), _url(dep, "prefill")
    prompt = random_prompt(22, 300)
    r = httpx.post(f"{url}/prefill", content=_prefill_body("dup2", prompt, False), headers=JSON, timeout=60, auth=auth)
    first = decode_body(r.content, PrefillResponse)
    try:
        r2 = httpx.post(f"{url}/prefill", content=_prefill_body("dup2", prompt, False), headers=JSON, timeout=60,
                        auth=auth)
        staged_after = _staged(dep)
        print(r2.status_code, r2.text[:200], "stagings left:", staged_after)
        assert r2.status_code == 409 and r2.json()["code"] == "duplicate_request_id", r2.text  # a clear error
        assert staged_after == 1  # the first call's staging is still there for its decode
    finally:
        _release(dep, first.handoff)
        assert_no_leaks(dep)


def test_a_prefill_sent_to_a_decode_worker_is_refused_clearly(dep):
    auth, url = dep.internal_client_auth(), _url(dep, "decode")
    r = httpx.post(f"{url}/prefill", content=_prefill_body("wrong-role", random_prompt(23, 100), False), headers=JSON,
                   timeout=60, auth=auth)
    print(r.status_code, r.text[:200])
    try:
        assert r.status_code == 409 and r.json()["code"] == "wrong_role", \
            r.text
    finally:
        assert_no_leaks(dep)
