"""Adversarial session 16 (helper): failure classes the earlier adversarial files do not cover,
against a real deployment (router + worker processes of the tiny random-weight Llama, real HTTP).

Findings:

- Options that change the answer were silently ignored. The request models ignore unknown fields
  (clients send many), and only OpenAI's own unsupported options (``n``, ``logprobs``, ``echo``,
  ``tools``...) were refused. The vLLM extensions that clients of an OpenAI-compatible server send
  to shape the prompt (chat ``add_generation_prompt: false``, ``continue_final_message``,
  ``chat_template``, ``chat_template_kwargs``, chat ``echo``) or to constrain or shape the output
  (``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
  ``structured_outputs``, ``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``,
  ``use_beam_search``, ``prompt_logprobs``, ``truncate_prompt_tokens``, ``skip_special_tokens:
  false``...), the legacy OpenAI ``functions`` / ``function_call``, and ``response_format`` on
  ``/v1/completions`` got 200 with an answer that ignored them: e.g. ``add_generation_prompt:
  false`` and ``continue_final_message: true`` gave the same 31 / 38 prompt tokens as without them,
  and ``guided_choice`` returned free text. The README promises "options we do not implement get a
  400, never silence". Now each of them gets a 400 naming it unless it holds its neutral value
  (the default a client may send explicitly), which is still accepted.

- A router that gives up on a worker call while it is still sending the body (its client hung up,
  or a bound expired) made the worker log ``ERROR: Exception in ASGI application`` with a 60-line
  ``starlette.requests.ClientDisconnect`` traceback (5 of 280 hang-ups in a live storm with the TCP
  handoff; deterministic with a raw socket that sends part of a ``/prefill`` body and closes). Nothing
  leaked and the worker kept serving, but an ERROR per abandoned call buries real errors and trips
  alerts. The worker app now answers a client gone while its body is read with 499, quietly.
- Same class, streamed prefill: a hang-up that reaches the worker just as the engine's answer does
  lost the cancellation of the prefill task (``asyncio.wait_for`` before Python 3.12), which then
  failed with "its handoff was not staged by the engine thread" after nobody awaited it, logged by
  asyncio as "Task exception was never retrieved" (2 in ~100 hang-ups, elastic deployment). The
  abandoned task's end is now retrieved; deterministic repro in
  ``tests/unit/test_prefill_lines_abandoned.py``.

What held (probes; no test needed beyond the existing files): ~45 completions and ~40 chat edge
bodies (``max_tokens`` 0 / null / 1e9 / -1 / float / string, batched prompts, empty prompts,
``n``, ``best_of``, ``logprobs``, ``echo``, 5 stops, empty stops, ``stream_options`` without
stream, seeds out of range, odd roles, content parts, images, lone surrogates, ...): 200 or a 400
with the OpenAI error body; HTTP oddities (no / wrong content type, chunked bodies, empty / null /
list bodies, unknown paths, wrong methods): 4xx with the error body. Client disconnects of 8
concurrent 1500-token requests at 0.05-1.5 s (plain and streamed): every worker idle with no block
or staging held 1.4 s after the first hang-up (abandoned work is cancelled, not finished). Streamed
text (``stream_options.include_usage``) equals the plain text and ``decode(token_ids)``, usage
counts equal, on 40 random prompts. KV pool pressure in ``cpd`` adaptive, float32, 48 L1 blocks a
worker and a 512 KiB L2: 12 multi-turn sessions sharing a 200-token prefix (72 requests, ~3.4k
decode evictions), 8 sessions x 8 turns, requests that need the whole pool (700 + 68, 767 + 1,
10 + 758 tokens at once), and 12 concurrent near-identical 500-token cold prompts: every token the
oracle's, every pool back to 0. Elastic roles (``--elastic``, planner every 0.5 s, dwell 1 s, no
hysteresis; 1 pre-prefill + 2 prefill + 1 decode, adaptive, float32): 90 s of six closed-loop clients
(multi-turn, 30 % cold, 20 % hang-ups) with 5 automatic role changes: 416 requests exact, no leak.
Manual role changes leaving no pre-prefill or no prefill worker: cold and warm requests still served
exact. L3 (file store) chunks bit-flipped, truncated, emptied, header-corrupted or deleted under a
warm request: recomputed, exact, counted as ``corrupt`` fallbacks. Seeded / penalised / ``min_p`` /
``stop_token_ids`` on the first (prefill-side) token with ``min_tokens``: 84 of 84 equal to one engine,
cold and warm. 24 concurrent > 4096-character text and chat prompts (tokenized in threads): all served.
"""
from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from deploy_util import assert_no_leaks, complete, random_prompt, start

CHAT = [{"role": "user", "content": "hi"}]

# (endpoint, field, a value that asks for something the server does not do)
SILENTLY_IGNORED = [
    ("chat", "add_generation_prompt", False),
    ("chat", "continue_final_message", True),
    ("chat", "chat_template", "{{ messages[0]['content'] }}"),
    ("chat", "chat_template_kwargs", {"enable_thinking": False}),
    ("chat", "echo", True),
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "function_call", "auto"),
    ("chat", "guided_json", {"type": "object"}),
    ("chat", "structured_outputs", {"choice": ["a", "b"]}),
    ("completions", "guided_choice", ["yes", "no"]),
    ("completions", "guided_regex", "[0-9]+"),
    ("completions", "guided_grammar", "root ::= 'a'"),
    ("completions", "response_format", {"type": "json_object"}),
    ("completions", "include_stop_str_in_output", True),
    ("completions", "allowed_token_ids", [1, 2, 3]),
    ("completions", "bad_words", ["the"]),
    ("completions", "use_beam_search", True),
    ("completions", "prompt_logprobs", 1),
    ("completions", "truncate_prompt_tokens", 1),
    ("completions", "skip_special_tokens", False),
]

# the same fields at their neutral value: a client may send the default explicitly
NEUTRAL = [
    ("chat", "add_generation_prompt", True),
    ("chat", "continue_final_message", False),
    ("chat", "chat_template", None),
    ("chat", "chat_template_kwargs", {}),
    ("chat", "echo", False),
    ("chat", "functions", []),
    ("chat", "function_call", "none"),
    ("completions", "guided_json", None),
    ("completions", "response_format", {"type": "text"}),
    ("completions", "include_stop_str_in_output", False),
    ("completions", "bad_words", []),
    ("completions", "use_beam_search", False),
    ("completions", "skip_special_tokens", True),
]


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1)
    yield d
    d.stop()


def _post(dep, endpoint: str, field: str, value) -> httpx.Response:
    body = {"model": dep.model_name, "max_tokens": 3, "temperature": 0, field: value}
    body.update({"messages": CHAT} if endpoint == "chat" else {"prompt": "hi"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(f"{dep.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("endpoint,field,value", SILENTLY_IGNORED, ids=[f"{e}-{f}" for e, f, _ in SILENTLY_IGNORED])
def test_an_option_that_would_change_the_answer_is_refused_not_ignored(dep, endpoint, field, value):
    r = _post(dep, endpoint, field, value)
    assert r.status_code == 400, f"{field}={value!r} answered {r.status_code}: {r.text[:300]}"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err


@pytest.mark.parametrize("endpoint,field,value", NEUTRAL, ids=[f"{e}-{f}" for e, f, _ in NEUTRAL])
def test_the_same_option_at_its_neutral_value_is_served(dep, endpoint, field, value):
    r = _post(dep, endpoint, field, value)
    assert r.status_code == 200, r.text[:300]


def test_a_caller_gone_while_sending_a_worker_its_body_is_not_an_error(dep):
    """Raw sockets send part of a body to each worker endpoint that reads one and close: the worker
    logs no ERROR traceback, holds nothing and keeps serving."""
    worker = next(w for w in dep.alive_workers() if w["worker_id"] == "p0")
    log_path = dep.log_dir / "p0.log"
    errors_before = log_path.read_text().count("Exception in ASGI application")
    url = urlsplit(worker["url"])
    for path in ("/prefill", "/decode", "/append", "/role", "/handoff/release"):
        with socket.create_connection((url.hostname, url.port), timeout=5) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: 100000\r\n\r\n{{\"request_id\": \"".encode())
            time.sleep(0.2)
    time.sleep(0.5)
    errors = log_path.read_text().count("Exception in ASGI application") - errors_before
    assert errors == 0, f"the worker logged {errors} ASGI errors for callers gone while sending"
    assert len(complete(dep, random_prompt(16, 40), 4)["choices"][0]["token_ids"]) == 4
    assert_no_leaks(dep)
