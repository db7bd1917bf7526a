"""Adversarial session 18 (helper): failure classes the earlier adversarial files do not use.
In-process OpenAI front (real tokenizer, a one-token backend, no deployment) and ``cpd serve``
subprocesses; ~15 s. Notes and probe figures: /work/notes/adversarial18.md.

Findings (each test here failed before its fix):

- Work before the context check grew with the body (up to the 16 MiB limit), not with the context.
  (a) A text prompt or chat far over the context was tokenized whole before being refused: live,
  8 concurrent 9 MB prompts took 110 s to get their 400s and held every tokenization thread, so an
  ordinary > 4 KiB chat request waited 105 s. A byte-level BPE tokenizer bounds the token count
  from below in linear time (no token stands for more than its longest, 81 bytes for SmolLM2):
  such a text is now refused with ``context_length_exceeded`` ("at least N tokens") unencoded
  (0.3-0.5 s each, the ordinary request 0.03 s). (b) A chat of 450,000 one-character (or empty)
  messages was validated twice on the event loop (1.2 s a request) and, with empty contents,
  rendered on it: 4 such requests held GET /health and every stream for 5-10 s (0.77 s after).
  (c) Their template rendering (~16 s each) ran in the thread pool every > 4 KiB prompt uses:
  inputs more than the context can hold now run on two threads of their own.
- 1,000,000 ``stop_token_ids`` (6 MB) were checked one by one and shipped with every worker call:
  3 such requests stalled a concurrent stream 0.89 s. Each distinct id now goes on once.
- Memory: each distinct ``cache_salt`` stayed whole in per-namespace caches (the root-hash table,
  4,096 namespaces of any size, in the router and every worker that hashed the request; the
  tokenizer's piece-cache scope): 300 chat requests with distinct 1 MB salts grew the router by
  330 MB and the prefill worker by 288 MB, and 300 more by as much again. A salt over 128
  characters is now kept as ``sha256:`` + its digest (+3 MB per 300 after).
- Options that change the answer, silently ignored: vLLM's ``stream_options.continuous_usage_stats:
  true`` (usage in every chunk) and ``add_special_tokens`` other than the value applied (true for
  completions, false for chat: a BOS added or not). Now 400s naming them; the neutral values pass.
- ``CPD_LOG_LEVEL=bogus`` ended ``cpd router`` / ``cpd worker`` in a traceback; now one line.
- ``cpd serve`` with an API key file it cannot read, an empty ``--api-key`` or an unreadable
  ``auth.internal_secret_file`` started every worker and then said only "router exited; see
  router.log"; a key file giving one key to two tenants was accepted (last tenant silently won).
  Now one line, exit 2, before anything starts; a key given to two tenants is refused.

What held (live probes, cpd/pd deployments of the tiny model in float32; no test beyond this file):
usage (prompt, completion and cached tokens) cold, L1-warm, decode-local append, streamed with
``include_usage`` and plain; the official ``openai`` client (streams with usage, batch of one token
list, 2-prompt batches, out-of-vocabulary ids, seeds at the int64/uint64 edges, ``tools``,
``parallel_tool_calls``, ``store``, ``metadata``, ``service_tier``, ``developer`` role, 4/5 stops,
``max_tokens`` exactly to the context); sampling edge values (temperature 5e-324, top_p 5e-324,
min_p 1, top_k 1e9 / -1, repetition_penalty 5e-324 / 1e308); invalid UTF-8, overlong encodings,
lone surrogates in prompt, stop and cache_salt; stop strings cut at random places, with
``min_tokens``, streamed vs plain (30 prompts); a 30-request identical-prompt storm with 40 %
hang-ups (adaptive cpd, 3 rounds); 10 multi-turn sessions with twins and hang-ups on ``pd`` 1+2,
TCP handoff, decode-local appends, 96-block pools (exact, usage right, nothing leaked); an L3 file
store on a full 600 KiB tmpfs (exact answers, no partial chunk files); 12 ``cpd serve`` flag errors;
4 x 3 MB stop strings beside a stream (its gap 0.21 s); with API keys, tenant B's request beside tenant
A's three on the same prompt, 12 rounds: B never reported a cached token; decode migration (``pd``
1+3, supervised, ``max_decode_migrations`` 2) of streams with penalties, seeded top_p, ``min_tokens``
with stop ids, seeded penalties with top_k, the decode worker SIGKILLed after 15 tokens: 4 of 4
equal to the uninterrupted answer (the repository's migration tests are greedy).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from starlette.testclient import TestClient

from cpd.router.openai_api import create_app
from cpd.router.protocol import GenerationChunk, GenerationRequest
from cpd.router.tokenization import Tokenizer

MAX_MODEL_LEN = 2048
ROOT = Path(__file__).resolve().parents[2]


class _OneToken:
    """A real GenerationBackend answering every request with one token."""

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk([42], "length", 0)


class _Recorder:
    """Delegates to a tokenizer part, recording the length of every text it is asked to encode."""

    def __init__(self, inner: Any, sizes: list[int]):
        self._inner, self._sizes = inner, sizes

    def encode(self, text, *a, **kw):
        self._sizes.append(len(text))
        return self._inner.encode(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def front(tiny_model_dir):
    """The OpenAI front over a one-token backend, with a tokenizer that records what it encodes."""
    from transformers import AutoTokenizer
    tok = Tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir)
    sizes: list[int] = []
    tok.hf = _Recorder(tok.hf, sizes)
    if tok.segments is not None:
        tok.segments = _Recorder(tok.segments, sizes)
    app = create_app(_OneToken(), tiny_model_dir, "tiny", MAX_MODEL_LEN, tokenizer=tok)
    with TestClient(app) as client:
        yield client, sizes


@pytest.mark.parametrize("kind", ["completions", "chat", "chat-parts"])
def test_a_text_far_over_the_context_is_refused_without_tokenizing_it(front, kind):
    """A 3 MB text (the body limit is 16 MiB) cannot fit 2048 tokens: no token of this tokenizer
    stands for more than 81 bytes. Before, the router tokenized all of it before its context check:
    live, 8 concurrent 9 MB prompts took 110 s to get their 400s, held every tokenization thread,
    and an ordinary > 4 KiB chat request waited 105 s behind them."""
    client, sizes = front
    text = "alpha béta gamma " * 180_000
    if kind == "completions":
        path, body = "/v1/completions", {"prompt": text, "max_tokens": 1}
    elif kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    else:
        parts = [{"type": "text", "text": text[i:i + 1000]} for i in range(0, len(text), 1000)]
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
    sizes.clear()
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"], err
    assert max(sizes, default=0) < 1_000_000, f"the router tokenized {max(sizes)} characters for a 400"


def test_a_text_that_fits_is_still_served_and_counted_exactly(front):
    """The bound refuses nothing that fits: 2,000 of this tokenizer's longest token ("\\n" and 80
    spaces: 162,000 bytes in 2,000 tokens) is served, plain and as a chat message."""
    client, _ = front
    text = ("\n" + " " * 80) * 2000
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2000
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text[:-81 * 30]}],
                                                  "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("flags, says", [
    (["--api-key-file", "/nonexistent/keys"], "/nonexistent/keys"),
    (["--api-key", ""], "empty"),
    (["--api-key-file", "{dup}"], "twice"),
    (["--set", "auth.internal_secret_file=/nonexistent/secret"], "/nonexistent/secret"),
])
def test_serve_with_keys_or_a_secret_it_cannot_use_says_so_before_starting(tiny_model_dir, tmp_path, flags, says):
    """Before, ``cpd serve`` started every worker (loading the model) and then reported only
    'router exited; see .../router.log' (the reason was in that log), or, for a key file that
    gives one key to two tenants, served with the last tenant silently (its KV shared with that
    tenant's). Now each is one line, exit 2, before any process starts."""
    dup = tmp_path / "keys"
    dup.write_text("k1 tenant-a\nk2 tenant-b\nk1 tenant-b\n")
    flags = [f.replace("{dup}", str(dup)) for f in flags]
    cmd = [sys.executable, "-m", "cpd.cli", "serve", "--model", tiny_model_dir, "--port", "0", *flags]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"cpd serve did not refuse {flags}; it started: {e.stdout!r}")
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert says in out and "starting" not in out and "Traceback" not in out, out


def test_a_chat_of_many_messages_is_checked_off_the_event_loop(front, monkeypatch):
    """A 15 MB body of 450,000 one-character messages: the router validated every message on its
    event loop (twice: the message check and the request model, 1.2 s per request here) before
    the context check, so every other request and stream of the router stood still meanwhile:
    live, 4 such requests held GET /health for 5-10 s. Now a chat body of many messages is
    checked in a worker thread, and the request model is given one already-checked message."""
    import threading

    from cpd.router import tokenization
    from cpd.router.openai_front import validation
    client, _ = front
    loop_threads: set[int] = set()
    on_loop: list[int] = []
    real = tokenization.normalize_messages

    def recording(messages):
        if isinstance(messages, list) and len(messages) > 1000 and threading.get_ident() in loop_threads:
            on_loop.append(len(messages))
        return real(messages)

    monkeypatch.setattr(validation, "normalize_messages", recording)
    monkeypatch.setattr(tokenization, "normalize_messages", recording)

    @client.app.get("/s18/loop-thread")
    async def loop_thread():
        loop_threads.add(threading.get_ident())
        return {}

    client.get("/s18/loop-thread")
    assert loop_threads
    for content in ("a", ""):  # "": the template alone is over the context
        body = {"messages": [{"role": "user", "content": content}] * 200_000, "max_tokens": 1}
        r = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert not on_loop, f"messages checked on the event loop: {on_loop} (content {content!r})"
    bad = {"messages": [{"role": "user", "content": "a"}] * 5000 + [{"role": "robot", "content": "a"}]}
    r = client.post("/v1/chat/completions", json=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[5000].role", r.text


def test_oversized_chats_being_rendered_do_not_hold_up_ordinary_requests(front, monkeypatch):
    """A chat body of many messages costs seconds of template rendering before its context check
    (16 s each for 450,000 messages here). Those renders ran in the thread pool every long prompt
    is tokenized in (6 threads on 2 cores), so 6 of them held up every ordinary request with a
    prompt over 4 KiB until they were done. Here the renders of 8 such bodies are held until the
    end: an ordinary 5,000-character chat request must be answered meanwhile."""
    import threading
    client, _ = front
    tok = client.app.state.front.tokenizer
    release = threading.Event()
    entered: list[int] = []
    real = type(tok).render_chat

    def held(messages):
        if len(messages) > 1000:
            entered.append(len(messages))
            release.wait(60)
        return real(tok, messages)

    monkeypatch.setattr(tok, "render_chat", held)
    big = {"messages": [{"role": "user", "content": ""}] * 3000, "max_tokens": 1}  # more than 2,048
    hogs = [threading.Thread(target=client.post, args=("/v1/chat/completions",), kwargs={"json": big}, daemon=True)
            for _ in range(8)]
    try:
        for t in hogs:
            t.start()
        done: dict = {}
        ordinary = threading.Thread(target=lambda: done.update(r=client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * 900}], "max_tokens": 1})),
            daemon=True)
        ordinary.start()
        ordinary.join(30)
        assert "r" in done, f"an ordinary request waited behind {len(entered)} oversized renders"
        assert done["r"].status_code == 200, done["r"].text
    finally:
        release.set()
        for t in hogs:
            t.join(60)


def test_stop_token_ids_go_on_once_each(tiny_model_dir):
    """1,000,000 stop ids (6 MB, under the body limit) were checked one by one and sent on with
    every prefill and decode call: live, 3 such requests made a concurrent stream stall 0.89 s
    between two tokens (0.01 s alone). Repeating an id changes nothing; each now goes on once."""
    seen: list[GenerationRequest] = []

    class Recording(_OneToken):
        async def generate(self, req):
            seen.append(req)
            yield GenerationChunk([42], "length", 0)

    app = create_app(Recording(), tiny_model_dir, "tiny", MAX_MODEL_LEN)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                 "stop_token_ids": [7, 3, 7] * 300_000 + [5]})
    assert r.status_code == 200, r.text
    assert sorted(seen[0].sampling.stop_token_ids) == [3, 5, 7], len(seen[0].sampling.stop_token_ids)


@pytest.mark.parametrize("program", ["router", "worker"])
def test_a_log_level_that_is_not_one_is_a_clear_error(tiny_model_dir, program):
    """``CPD_LOG_LEVEL=bogus`` ended ``cpd router`` / ``cpd worker`` in a ValueError traceback."""
    import os
    args = ["--served-from", "http://127.0.0.1:1"] if program == "router" else \
        ["--role", "prefill", "--model", tiny_model_dir, "--port", "0"]
    p = subprocess.run([sys.executable, "-m", "cpd.cli", program, *args], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "CPD_LOG_LEVEL": "bogus"})
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "CPD_LOG_LEVEL" in out and "Traceback" not in out, out


def test_a_long_cache_salt_is_kept_as_a_digest(tiny_model_dir):
    """Each distinct cache_salt stayed in per-namespace caches of the router and of every worker
    that hashed its blocks (the root-hash table holds 4,096 namespaces, whatever their size) and
    travelled with every worker call: live, 300 chat requests with distinct 1 MB salts grew the
    router by 330 MB and the prefill worker by 288 MB, and 300 more by as much again (a client
    under the 16 MiB body limit could exhaust memory). A salt over 128 characters now becomes
    'sha256:' + its digest at the router's door (as does any salt that starts like one, so that no
    two salts meet); shorter salts are unchanged."""
    from cpd.router.api_keys import TenantScopedBackend, effective_cache_salt
    seen: list[str | None] = []

    class Recording(_OneToken):
        async def generate(self, req):
            seen.append(req.cache_salt)
            yield GenerationChunk([42], "length", 0)

    long_a, long_b = "a" * 1_000_000, "a" * 999_999 + "b"
    app = create_app(TenantScopedBackend(Recording()), tiny_model_dir, "tiny", MAX_MODEL_LEN)
    salts = [long_a, long_b, long_a, "x", effective_cache_salt(None, long_a) or ""]
    with TestClient(app) as client:
        for salt in salts:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 1, "cache_salt": salt})
            assert r.status_code == 200, r.text
    assert all(s is not None and len(s) <= 128 for s in seen), [len(s or "") for s in seen]
    assert seen[0] == seen[2] and len({seen[0], seen[1], seen[3], seen[4]}) == 4 and seen[3] == "x", seen
    tenant_salts = {effective_cache_salt(t, b) for t in ("alice", "bob") for b in (None, long_a, long_b)}
    assert len(tenant_salts) == 6 and all(len(s or "") <= 128 for s in tenant_salts)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_asked_for_is_refused(front, chat):
    """vLLM's ``stream_options.continuous_usage_stats: true`` asks for usage in every chunk; it was
    ignored (200, usage only at the end), against the README's 400 for options not implemented."""
    client, _ = front
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    for value, status in ((True, 400), (False, 200), (None, 200)):
        body = {**prompt, "max_tokens": 1, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": value}}
        r = client.post(path, json=body)
        assert r.status_code == status, (value, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text


@pytest.mark.parametrize("chat, neutral", [(False, True), (True, False)])
def test_add_special_tokens_other_than_ours_is_refused(front, chat, neutral):
    """vLLM's ``add_special_tokens`` changes the prompt (a BOS added or not: completions add the
    tokenizer's special tokens, chat prompts get the template's only); any value was ignored. The
    value this server applies is served, the other one is a 400."""
    client, _ = front
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    r = client.post(path, json={**prompt, "max_tokens": 1, "add_special_tokens": neutral})
    assert r.status_code == 200, r.text
    r = client.post(path, json={**prompt, "max_tokens": 1, "add_special_tokens": not neutral})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text
