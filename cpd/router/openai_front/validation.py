"""Validation the request models cannot state: field-path error messages (``param``),
unsupported OpenAI options, stop strings, the one prompt of a completions body, union fields."""
from __future__ import annotations

from typing import Any, Iterable

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from cpd.router.errors import APIError, invalid
from cpd.router.openai_front.models import (MAX_STOP_STRINGS, ChatCompletionRequest, CommonRequest,
                                            CompletionRequest)
from cpd.router.tokenization import MessageError, normalize_messages


_TYPE_TAGS = frozenset({"str", "int", "float", "bool"})


def is_union_tag(part: str) -> bool:
    """pydantic names the member of a union that failed (``str``, ``list[constrained-int]``,
    ``TextContentPart``...) in the error location; it is not part of the field path."""
    return part in _TYPE_TAGS or not part.isidentifier() or part[:1].isupper()


def param_of(loc: Iterable[Any]) -> str | None:
    out = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and is_union_tag(part)):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    errs = e.errors()
    first = errs[0] if errs else {}
    param = param_of(first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = f"'{param}' is a required property"
    elif param:
        msg = f"Invalid value for '{param}': {msg}"
    return invalid(msg, param)


def check_unsupported(req: CommonRequest, chat: bool) -> None:
    if req.n is not None and req.n != 1:
        raise invalid("only n=1 is supported", "n")
    if chat:
        if req.logprobs not in (None, False):
            raise invalid("logprobs are not supported", "logprobs")
    elif req.logprobs is not None:
        raise invalid("logprobs are not supported", "logprobs")
    if req.top_logprobs is not None:
        raise invalid("top_logprobs are not supported", "top_logprobs")
    if req.logit_bias not in (None, {}):
        raise invalid("logit_bias is not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise invalid("echo=true is not supported", "echo")
        if req.best_of is not None and req.best_of != 1:
            raise invalid("only best_of=1 is supported", "best_of")
        if req.suffix not in (None, ""):
            raise invalid("suffix is not supported", "suffix")
    if isinstance(req, ChatCompletionRequest):
        if req.tools not in (None, []):
            raise invalid("tools are not supported", "tools")
        if req.tool_choice not in (None, "none"):
            raise invalid("tool_choice is not supported", "tool_choice")
        rf = req.response_format
        if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
            raise invalid("only response_format {'type': 'text'} is supported", "response_format")


# Options of other OpenAI-compatible servers (vLLM's extensions, OpenAI's legacy function calling)
# that change the prompt or the answer, which this server does not implement. The request models
# ignore unknown fields, so these are checked on the raw body: each is refused unless absent, null,
# or at the neutral value listed (the default a client may send explicitly). Options whose effect
# this server already gives, or which change nothing in the answer, are not listed.
UNSUPPORTED_EXTENSIONS: dict[str, tuple[Any, ...]] = {
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "include_stop_str_in_output": (False,), "allowed_token_ids": (),
    "bad_words": ([],), "use_beam_search": (False,), "prompt_logprobs": (), "truncate_prompt_tokens": (),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "logits_processors": ([],),
}
UNSUPPORTED_CHAT_EXTENSIONS: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "echo": (False,), "documents": ([],), "functions": ([],),
    "function_call": ("none",),
    # OpenAI's output modalities and built-in tools: audio output, web search
    "modalities": (["text"],), "audio": (), "web_search_options": (),
    "add_special_tokens": (False,),  # vLLM: the template writes the special tokens
}
UNSUPPORTED_COMPLETIONS_EXTENSIONS: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},),
    "add_special_tokens": (True,),  # vLLM: the tokenizer's (e.g. BOS) are added to a text prompt
}
# Fields inside an object of the body, as (object, field): vLLM's usage in every stream chunk.
UNSUPPORTED_NESTED_EXTENSIONS: dict[tuple[str, str], tuple[Any, ...]] = {
    ("stream_options", "continuous_usage_stats"): (False,),
}


def check_unsupported_extensions(obj: dict[str, Any], chat: bool) -> None:
    """400 for a field of :data:`UNSUPPORTED_EXTENSIONS` (and the endpoint's own table) that asks for
    something: an answer that silently ignored it would not be the one asked for."""
    table = {**UNSUPPORTED_EXTENSIONS,
             **(UNSUPPORTED_CHAT_EXTENSIONS if chat else UNSUPPORTED_COMPLETIONS_EXTENSIONS)}
    for name, neutral in table.items():
        _refuse_unless_neutral(obj.get(name), neutral, name)
    for (outer, name), neutral in UNSUPPORTED_NESTED_EXTENSIONS.items():
        inner = obj.get(outer)
        if isinstance(inner, dict):
            _refuse_unless_neutral(inner.get(name), neutral, f"{outer}.{name}")


def _refuse_unless_neutral(value: Any, neutral: tuple[Any, ...], name: str) -> None:
    if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
        raise invalid(f"'{name}' is not supported by this server (only its default is accepted)", name)


def parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise invalid("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    if any(s == "" for s in stops):
        raise invalid("stop strings must not be empty", "stop")
    return stops


def single_prompt(prompt: Any) -> str | list[int]:
    """The one prompt of a completions body (text or token ids; a batch of one is unwrapped).
    Raises a 400 naming the problem for anything else."""
    if prompt is None:
        raise invalid("'prompt' is a required property", "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise invalid("batched prompts are not supported; send one prompt per request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt == "":
            raise invalid("prompt must not be empty", "prompt")
        return prompt
    if not isinstance(prompt, list) or not is_token_list(prompt):
        raise invalid("'prompt' must be a string or a list of integer token ids", "prompt")
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    return prompt


def check_union_fields(obj: dict[str, Any], chat: bool) -> str | list[int] | None:
    """Check the fields whose schema is a union (``prompt``, ``messages``, ``stop``) before the
    model does: a union's validation error lists every member's failure, while these checks
    name the one problem and the exact ``param`` (``messages[1].content[0]``). Returns the one
    prompt of a completions body (:func:`single_prompt`), None for chat."""
    prompt = None
    if chat:
        if obj.get("messages") is None:
            raise invalid("'messages' is a required property", "messages")
        try:
            normalize_messages(obj["messages"])
        except MessageError as e:
            raise invalid(str(e), e.param) from None
    else:
        prompt = single_prompt(obj.get("prompt"))
    parse_stop(obj.get("stop"))
    return prompt


def token_range(prompt: str | list[int] | None) -> tuple[int, int] | None:
    """``(min, max)`` of a token-id prompt (two C-level passes), None for anything else or an empty list."""
    if not isinstance(prompt, list) or not prompt:
        return None
    return min(prompt), max(prompt)


def without_token_prompt(obj: dict[str, Any], prompt: str | list[int] | None,
                         bounds: tuple[int, int] | None = None) -> dict[str, Any]:
    """``obj`` for the request model: a token-id ``prompt`` (a list of ints, :func:`single_prompt`)
    whose ids are all >= 0 passes the model's ``prompt`` schema whatever its length, so the model is
    given a one-id stand-in of the same shape instead (validating 128K ids one by one costs ~10 ms);
    the caller keeps using the real prompt. Anything else (text, a negative id) is validated as is,
    so every error is the model's own. ``bounds``: :func:`token_range` of ``prompt`` if known."""
    if not isinstance(prompt, list) or len(prompt) < 2:
        return obj
    if (bounds or token_range(prompt) or (0, 0))[0] < 0:
        return obj
    raw = obj["prompt"]
    return {**obj, "prompt": [0] if raw is prompt else [[0]]}


def is_token_list(x: Any) -> bool:
    """A list of ints (no bools), checked in one C-level pass (a 128K-token prompt: ~3 ms)."""
    return isinstance(x, list) and _INT_ONLY.issuperset(map(type, x))


_INT_ONLY = frozenset({int})  # JSON gives exactly int for an integer (bool for true/false)
