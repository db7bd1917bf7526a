"""The router's fast paths for long prompts give exactly what the plain paths gave (issue 13,
router overhead): body parsing (msgspec first, :func:`json.loads` for what it refuses), the
C-level list checks, the request model validated with a stand-in for a long token-id prompt, and
the prefill answer read without its prompt echo."""
from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from cpd.messages.worker_api import (PrefillAnswer, PrefillAnswerLine, PrefillLine, PrefillResponse, decode_body,
                                     encode)
from cpd.router.errors import APIError
from cpd.router.openai_front.models import ChatCompletionRequest, CompletionRequest
from cpd.router.openai_front.validation import (check_union_fields, is_token_list, single_prompt,
                                                without_token_prompt)
from cpd.router.request_body import MAX_JSON_DEPTH, _has_surrogate, _param, _surrogate_error, parse_json_object
from cpd.router.errors import invalid
from cpd.types import Tier


# --- the plain path as it was (json.loads + a Python walk over every value): the oracle -----------
def _plain_check_tree(obj):
    stack = [(obj, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                          _param(path), "json_nesting_too_deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and _has_surrogate(key):
                raise _surrogate_error(path)
            if isinstance(value, str):
                if _has_surrogate(value):
                    raise _surrogate_error(path + (key,))
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, path + (key,)))


def _plain_parse(raw: bytes):
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise invalid(f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                      code="json_nesting_too_deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise invalid("request body must be a JSON object")
    _plain_check_tree(obj)
    return obj


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except APIError as e:
        return ("error", e.status, e.message, e.param, e.code)


def _nan_equal(a, b) -> bool:
    return json.dumps(a, sort_keys=False) == json.dumps(b, sort_keys=False)


rng = random.Random(7)
LONG_IDS = [rng.randrange(49152) for _ in range(5000)]
BODIES = [
    b'{"prompt": [1, 2, 3], "max_tokens": 4}',
    json.dumps({"prompt": LONG_IDS, "max_tokens": 4}).encode(),
    json.dumps({"prompt": LONG_IDS + ["\ud800"]}).encode(),           # a lone surrogate at the end of a long list
    json.dumps({"prompt": LONG_IDS[:100] + [[1, "x\udc00"]]}).encode(),  # ... nested in it
    json.dumps({"prompt": [1.5] * 100 + [None, True, False]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "h\u00e9llo \U0001F600"}]}).encode(),
    json.dumps({"a\ud800": 1}).encode(),                                # escaped lone surrogate in a key
    b'{"a": "\xed\xa0\x80"}',                                           # a surrogate as raw UTF-8 bytes
    b'{"a": NaN, "b": Infinity, "c": -Infinity}',
    b'{"a": 1e400}',
    b'\xef\xbb\xbf{"a": 1}',                                            # UTF-8 BOM
    '{"a": "x"}'.encode("utf-16"),
    '{"a": "x"}'.encode("utf-32-le"),
    b'{"a": 1, "a": 2}',
    b'{"a": 123456789012345678901234567890, "b": -0.0, "c": 0.1e1, "d": 5e-324}',
    b'{"a": "tab\there"}',
    b'{"a": 1',
    b'\xff\xfe',
    b'[1, 2]',
    b'"text"',
    b' {"a": [] } \n',
    b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
    b'{"a":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
    b'{"a":' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}",
    b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"a":' + b"{\"b\":" * 3000 + b"1" + b"}" * 3000 + b"}",
]


@pytest.mark.parametrize("raw", BODIES, ids=range(len(BODIES)))
def test_parse_matches_the_plain_path(raw):
    got, want = _outcome(parse_json_object, raw), _outcome(_plain_parse, raw)
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        assert _nan_equal(got[1], want[1])
        assert type(got[1]) is dict
    else:
        assert got == want


def test_parse_fuzz_matches_the_plain_path():
    """Random JSON-ish byte strings (mutations of valid bodies) parse or fail the same way."""
    r = random.Random(3)
    alphabet = b'{}[],:"\\ 0123456789.eE-+truefalsnul\xc3\xa9\xed\xa0\x80ud800'
    seeds = [b'{"prompt": [1, 2, 3], "stop": ["a"]}', b'{"messages": [{"role": "user", "content": "x\\u00e9"}]}']
    for _ in range(3000):
        raw = bytearray(r.choice(seeds))
        for _ in range(r.randint(1, 4)):
            i = r.randrange(len(raw) + 1)
            if r.random() < 0.5 and raw:
                del raw[min(i, len(raw) - 1)]
            else:
                raw[i:i] = bytes([r.choice(alphabet)])
        got, want = _outcome(parse_json_object, bytes(raw)), _outcome(_plain_parse, bytes(raw))
        assert got[0] == want[0], (bytes(raw), got, want)
        assert (got[0] == "ok" and _nan_equal(got[1], want[1])) or got == want, (bytes(raw), got, want)


@pytest.mark.parametrize("x", [[], [1], [1, True], [True], [1, 2.0], [1, "a"], [[1]], [1, None], LONG_IDS,
                               LONG_IDS + [False], "abc", None, {"a": 1}, [2 ** 70, -3]])
def test_is_token_list_matches_the_plain_check(x):
    plain = isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    assert is_token_list(x) is plain


def _validation(model, obj):
    try:
        m = model.model_validate(obj)
        return ("ok", m.model_dump(exclude={"prompt"}))
    except ValidationError as e:
        return ("error", [(err["loc"], err["type"]) for err in e.errors()][:1])


COMPLETION_BODIES = [
    {"prompt": LONG_IDS, "max_tokens": 4},
    {"prompt": [LONG_IDS], "max_tokens": 4, "temperature": 0.5},
    {"prompt": LONG_IDS[:10] + [-1] + LONG_IDS[:10]},              # a negative id: the model's own error
    {"prompt": [LONG_IDS[:10] + [-5]]},
    {"prompt": LONG_IDS, "max_tokens": 0},                         # another field's error
    {"prompt": LONG_IDS, "temperature": "hot"},
    {"prompt": LONG_IDS, "n": "two", "stream": 1},
    {"prompt": [7]},
    {"prompt": [2 ** 70, 3]},
    {"prompt": "text prompt", "max_tokens": 3},
    {"prompt": LONG_IDS, "seed": 2 ** 80},
]


@pytest.mark.parametrize("obj", COMPLETION_BODIES, ids=range(len(COMPLETION_BODIES)))
def test_request_model_verdict_unchanged_by_the_stand_in(obj):
    prompt = check_union_fields(obj, chat=False)
    assert prompt == single_prompt(obj["prompt"])
    before = json.dumps(obj)
    stand_in = without_token_prompt(obj, prompt)
    assert _validation(CompletionRequest, stand_in) == _validation(CompletionRequest, obj)
    assert json.dumps(obj) == before  # the body itself is left as it is
    if stand_in is not obj:  # a token list with no negative id, stood in for by one id of the same shape
        assert isinstance(prompt, list) and min(prompt) >= 0
        assert stand_in["prompt"] == ([0] if obj["prompt"] is prompt else [[0]])


def test_chat_bodies_are_validated_as_they_are():
    obj = {"messages": [{"role": "user", "content": "hi"}]}
    assert check_union_fields(obj, chat=True) is None
    assert without_token_prompt(obj, None) is obj
    ChatCompletionRequest.model_validate(obj)


def test_prefill_answer_line_skips_the_prompt_echo():
    """A worker's answer line carries no echo of the prompt; one from an older worker (the prompt in
    ``token_ids``) is read as the same :class:`PrefillAnswer`, the echo skipped."""
    ans = PrefillResponse(first_token_ids=[42], finish_reason=None, num_cached_tokens_by_tier={Tier.L1: 32},
                          prefill_s=0.5, queue_s=0.1, compute_s=0.4, kv_bytes=1234,
                          fallback={"x": 1}, transfers={Tier.L3: (10, 0.5)}, step_tokens=99, step_s=0.25)
    raw = encode(PrefillLine(answer=ans))
    assert b"token_ids" not in raw.replace(b"first_token_ids", b"")
    old = json.loads(raw)
    old["answer"]["token_ids"] = LONG_IDS + [42]
    lean = decode_body(json.dumps(old).encode(), PrefillAnswerLine).answer
    assert type(lean) is PrefillAnswer and not hasattr(lean, "token_ids")
    assert lean == decode_body(raw, PrefillLine).answer == ans
    progress = encode(PrefillLine(num_engine_steps=3, engine_stuck=True, request_state="queued"))
    assert decode_body(progress, PrefillAnswerLine).num_engine_steps == 3
