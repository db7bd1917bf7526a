"""The router's OpenAI-compatible HTTP front, independent of how tokens are produced.

:func:`create_app` builds a FastAPI app that serves

- ``POST /v1/completions``       — OpenAI API reference, "Completions" (legacy) object and
  streamed chunks (``object: "text_completion"``);
- ``POST /v1/chat/completions``  — OpenAI API reference, "Chat Completions": the
  ``chat.completion`` object and ``chat.completion.chunk`` stream events;
- ``GET /v1/models``, ``GET /v1/models/{model}`` — OpenAI "Models" list/retrieve
  (``owned_by: "cpd"``, plus ``max_model_len``);
- ``GET /health``                — ``200 {"status": "ok"}`` (a caller may replace it).

Requests are validated and tokenized here (prompt strings with
:meth:`Tokenizer.encode_prompt`, chat messages with :meth:`Tokenizer.apply_chat_template`),
then handed to a :class:`~cpd.router.protocol.GenerationBackend` as a
:class:`~cpd.router.protocol.GenerationRequest`. Output token ids are detokenized
incrementally (:mod:`cpd.router.detokenize`): deltas never split a UTF-8 character, stop
strings cut the text (and close the backend generator, which cancels the request).

Streaming uses server-sent events: ``data: <json chunk>\\n\\n`` lines, ending with
``data: [DONE]\\n\\n``. With ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk has ``"choices": []`` and the usage. The first backend
chunk is awaited before the HTTP status is sent, so a :class:`BackendError` raised before the
first token still becomes a real 429/503 response; an error after that is sent as one
``data: {"error": {...}}`` event followed by ``[DONE]``.

Backend generator lifecycle: after a chunk with ``finish_reason`` the front asks for one more
item so that the generator ends normally (code after its last ``yield`` runs); any extra chunk
is ignored. Cancellation: the backend generator is closed when a stop string matches, when the client
disconnects (streaming and non-streaming alike: the front listens for the ASGI
``http.disconnect`` message while generating), or on any error.

Errors (body always ``{"error": {"message", "type", "param", "code"}}``, see
:mod:`cpd.router.errors`):

==========================================================  ======  =============================
condition                                                   status  type / code
==========================================================  ======  =============================
body over ``max_request_body_bytes`` (default 16 MiB)       413     invalid_request_error / request_too_large
body is not JSON / not a JSON object                        400     invalid_request_error
JSON nested deeper than 32 levels                           400     invalid_request_error / json_nesting_too_deep
a lone UTF-16 surrogate in any string or key                400     invalid_request_error / invalid_unicode
field missing or of the wrong type (``param`` = field)      400     invalid_request_error
``model`` not served                                        404     invalid_request_error / model_not_found
empty prompt / no messages / batched prompts                400     invalid_request_error
token id not an int or outside ``[0, vocab_size)``          400     invalid_request_error
``max_tokens`` < 1, temperature ∉ [0, 2], top_p ∉ (0, 1]    400     invalid_request_error
unsupported option (``n``≠1, ``logprobs``, ``echo``...)     400     invalid_request_error
prompt tokens > ``max_model_len``                           400     invalid_request_error / context_length_exceeded
prompt + ``max_tokens`` > ``max_model_len``                 400     invalid_request_error / context_length_exceeded
unknown route / method                                      404/405 not_found_error / invalid_request_error
:class:`BackendError`                                       its own (429/503 add ``Retry-After``)
anything unexpected                                         500     server_error
==========================================================  ======  =============================

FastAPI's 422 is never used: request-model validation errors map to 400. The request models
(:class:`CompletionRequest`, :class:`ChatCompletionRequest`) validate every body and generate
``GET /openapi.json``. ``max_model_len`` is the router's limit; workers with a smaller context
are refused (:mod:`cpd.router.compat`), so a request within it fits every worker used.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Awaitable, Callable, Iterable, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError)
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpd.messages.sampling import SamplingParams
from cpd.router.detokenize import IncrementalDetokenizer, StopStringMatcher
from cpd.router.errors import (INVALID_REQUEST, SERVER_ERROR, APIError, error_response, invalid,
                               type_for_status)
from cpd.router.openapi import install_openapi
from cpd.router.request_body import (DEFAULT_MAX_REQUEST_BODY_BYTES, ClientGoneWhileReading,
                                     read_json_body)
from cpd.router.protocol import (BackendError, GenerationBackend, GenerationChunk,
                                 GenerationRequest)
from cpd.router.tokenization import MessageError, Tokenizer, load_tokenizer, normalize_messages

log = logging.getLogger("cpd.router.openai_api")

DEFAULT_COMPLETIONS_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``; chat defaults to the rest of the
context (``max_model_len - prompt_tokens``)."""
MAX_STOP_STRINGS = 4
SEED_RANGE = (-(2 ** 63), 2 ** 64)
_LONG_TEXT_CHARS = 4096  # tokenize longer inputs in a worker thread


# ----------------------------------------------------------------------------- request models

TokenId = Annotated[StrictInt, Field(ge=0, description="token id in [0, vocab_size)")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[StrictBool] = False


class TextContentPart(BaseModel):
    """One part of a chat message's ``content`` list (only text parts are supported)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One chat message (OpenAI "Create chat completion", ``messages``); ``developer`` is an
    alias of ``system``; a content list is joined with no separator."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[TextContentPart]]


class _CommonRequest(BaseModel):
    """Fields shared by both endpoints. Unknown fields are ignored (clients send many).

    These models are the schema: they validate every request body (types and ranges) and
    ``GET /openapi.json`` is generated from them. Rules a JSON schema cannot state (token ids
    below the vocabulary size, prompt + ``max_tokens`` within the context, unsupported values of
    the OpenAI options listed as ``unsupported``) are checked after validation.
    """

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = Field(None, description="the served model id (optional)")
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    temperature: Optional[Annotated[StrictFloat, Field(ge=0.0, le=2.0, allow_inf_nan=False)]] = None
    top_p: Optional[Annotated[StrictFloat, Field(gt=0.0, le=1.0, allow_inf_nan=False)]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])]] = None
    stop: Optional[Union[Annotated[StrictStr, Field(min_length=1)],
                         Annotated[list[Annotated[StrictStr, Field(min_length=1)]],
                                   Field(max_length=MAX_STOP_STRINGS)]]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = Field(None, description="only with stream: true")
    ignore_eos: Optional[StrictBool] = False       # vLLM extension
    cache_salt: Optional[Annotated[StrictStr, Field(min_length=1)]] = None  # vLLM extension
    stop_token_ids: Optional[list[TokenId]] = None  # vLLM extension
    return_token_ids: Optional[StrictBool] = False  # vLLM extension (non-streaming): ids in the choice
    n: Optional[StrictInt] = Field(None, description="unsupported: only 1")
    user: Any = None
    logprobs: Any = Field(None, description="unsupported")
    top_logprobs: Any = Field(None, description="unsupported")
    presence_penalty: Optional[StrictFloat] = Field(None, description="unsupported: only 0")
    frequency_penalty: Optional[StrictFloat] = Field(None, description="unsupported: only 0")
    logit_bias: Any = Field(None, description="unsupported")


class CompletionRequest(_CommonRequest):
    """Body of ``POST /v1/completions`` (OpenAI "Create completion"). ``prompt``: text, token
    ids, or a batch of exactly one of either."""

    prompt: Union[Annotated[StrictStr, Field(min_length=1)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]]
    echo: Optional[StrictBool] = Field(None, description="unsupported: only false")
    best_of: Optional[StrictInt] = Field(None, description="unsupported: only 1")
    suffix: Any = Field(None, description="unsupported")


class ChatCompletionRequest(_CommonRequest):
    """Body of ``POST /v1/chat/completions`` (OpenAI "Create chat completion")."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    tools: Any = Field(None, description="unsupported")
    tool_choice: Any = Field(None, description="unsupported: only 'none'")
    response_format: Any = Field(None, description="only {'type': 'text'}")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool"})


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union that failed (``str``, ``list[constrained-int]``,
    ``TextContentPart``...) in the error location; it is not part of the field path."""
    return part in _TYPE_TAGS or not part.isidentifier() or part[:1].isupper()


def _param_of(loc: Iterable[Any]) -> str | None:
    out = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and _is_union_tag(part)):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    errs = e.errors()
    first = errs[0] if errs else {}
    param = _param_of(first.get("loc", ()))
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = f"'{param}' is a required property"
    elif param:
        msg = f"Invalid value for '{param}': {msg}"
    return invalid(msg, param)


# ----------------------------------------------------------------------------- helpers

@dataclass
class _Prepared:
    endpoint: str                 # "completions" | "chat.completions"
    request_id: str
    created: int
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    cache_salt: str | None
    arrival: float
    return_token_ids: bool = False


def _check_unsupported(req: _CommonRequest, chat: bool) -> None:
    if req.n is not None and req.n != 1:
        raise invalid("only n=1 is supported", "n")
    if chat:
        if req.logprobs not in (None, False):
            raise invalid("logprobs are not supported", "logprobs")
    elif req.logprobs is not None:
        raise invalid("logprobs are not supported", "logprobs")
    if req.top_logprobs is not None:
        raise invalid("top_logprobs are not supported", "top_logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and v != 0:
            raise invalid(f"{name} is not supported (must be 0)", name)
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


def _parse_stop(stop: Any) -> list[str]:
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


def _single_prompt(prompt: Any) -> str | list[int]:
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
    if not isinstance(prompt, list) or not _is_token_list(prompt):
        raise invalid("'prompt' must be a string or a list of integer token ids", "prompt")
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    return prompt


def _check_union_fields(obj: dict[str, Any], chat: bool) -> None:
    """Check the fields whose schema is a union (``prompt``, ``messages``, ``stop``) before the
    model does: a union's validation error lists every member's failure, while these checks
    name the one problem and the exact ``param`` (``messages[1].content[0]``)."""
    if chat:
        if obj.get("messages") is None:
            raise invalid("'messages' is a required property", "messages")
        try:
            normalize_messages(obj["messages"])
        except MessageError as e:
            raise invalid(str(e), e.param) from None
    else:
        _single_prompt(obj.get("prompt"))
    _parse_stop(obj.get("stop"))


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


async def _tokenize(fn: Callable[[Any], list[int]], arg: Any, size: int) -> list[int]:
    if size > _LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)


async def _aclose(agen: Any) -> None:
    close = getattr(agen, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:  # a backend failing to close must not mask the real outcome
        log.exception("backend generator raised while closing")


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Return when the ASGI server reports ``http.disconnect`` (call only after the body
    has been read completely)."""
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            return


class _ClientGone(Exception):
    pass


class _CancelOnDisconnect:
    """``async with _CancelOnDisconnect(receive):`` — if the client disconnects while the body
    runs, the *current* task is cancelled and the block raises :class:`_ClientGone`.

    Cancelling the current task (instead of running the work in a helper task) keeps every
    step of the backend generator in one task, so generators that hold task-bound state
    across ``yield`` (anyio cancel scopes, context variables) keep working. Call only after
    the request body has been read completely.
    """

    def __init__(self, receive: Callable[[], Awaitable[dict]]):
        self._receive = receive
        self.gone = False

    async def __aenter__(self) -> "_CancelOnDisconnect":
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        await _wait_disconnect(self._receive)
        self.gone = True
        self._task.cancel()

    async def __aexit__(self, et, exc, tb) -> bool:
        self._watch.cancel()
        if not self.gone:
            return False
        uncancel = getattr(self._task, "uncancel", None)   # Python >= 3.11
        if uncancel is not None:
            uncancel()
        if et is None or issubclass(et, (asyncio.CancelledError, _ClientGone)):
            raise _ClientGone()
        return False


class _TextState:
    """Per-request output state: token count, detokenizer, stop strings, finish reason."""

    def __init__(self, tok: Tokenizer, stops: list[str], max_tokens: int):
        self.detok = IncrementalDetokenizer(tok)
        self.stopper = StopStringMatcher(stops)
        self.max_tokens = max_tokens
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # every generated id counted in completion_tokens
        self.cached_tokens: int | None = None
        self.finish_reason: str | None = None
        self.backend_finished = False   # the backend itself said it is done

    def on_chunk(self, chunk: GenerationChunk) -> str:
        """Text that may be sent now; sets ``finish_reason`` when the request is over."""
        if self.cached_tokens is None and chunk.num_cached_tokens is not None:
            self.cached_tokens = int(chunk.num_cached_tokens)
        ids = list(chunk.token_ids or ())
        finish = chunk.finish_reason
        room = self.max_tokens - self.completion_tokens
        if len(ids) > room:           # backend overshot max_tokens: cut it off
            ids = ids[:max(room, 0)]
            finish = "length"
        self.completion_tokens += len(ids)
        self.token_ids.extend(ids)
        out, stopped = self.stopper.feed(self.detok.push(ids))
        if stopped:
            self.finish_reason = "stop"
            return out
        if finish is not None:
            self.backend_finished = finish == chunk.finish_reason
            return out + self._finish(finish)
        return out

    def on_end(self) -> str:
        """The backend ended without a finish reason."""
        if self.finish_reason is not None:
            return ""
        return self._finish("length" if self.completion_tokens >= self.max_tokens else "stop")

    def _finish(self, reason: str) -> str:
        out, stopped = self.stopper.feed(self.detok.flush())
        if stopped:
            self.finish_reason = "stop"
            return out
        self.finish_reason = reason if reason in ("stop", "length") else "stop"
        return out + self.stopper.flush()

    def usage(self, prompt_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0}}


async def _drain(it: Any) -> None:
    """After a chunk with ``finish_reason``, let the backend generator run to its end (so
    code after its last ``yield`` runs, e.g. bookkeeping) instead of closing it at the yield.
    An extra chunk is ignored (the caller closes the generator afterwards)."""
    try:
        await it.__anext__()
    except StopAsyncIteration:
        pass
    except Exception:
        log.warning("backend generator failed after its final chunk", exc_info=True)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"


class _SSEResponse(Response):
    """A ``text/event-stream`` response driven by ``producer(emit)``.

    While the producer runs, the response also listens for ``http.disconnect``; on
    disconnect it cancels the producer (whose ``finally`` closes the backend generator).
    This does not depend on the ASGI server's spec version or on a send() failing.
    The producer runs in the request's own task.
    """

    media_type = "text/event-stream"

    def __init__(self, producer: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]]):
        # no Response.__init__: it would set a body and "content-length: 0"
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._producer = producer

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            async with _CancelOnDisconnect(receive):
                await self._producer(emit)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (_ClientGone, OSError):
            pass   # the producer's finally has closed the backend generator


# ----------------------------------------------------------------------------- the front

class OpenAIFront:
    """State behind the HTTP routes: backend, tokenizer, model facts. ``app.state.front``."""

    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, vocab_size: int | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES):
        if max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(vocab_size if vocab_size is not None else tokenizer.vocab_size)
        self.created = int(time.time())
        self.max_request_body_bytes = int(max_request_body_bytes)

    # -- request preparation ------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            return await read_json_body(request, self.max_request_body_bytes)
        except ClientGoneWhileReading:
            raise _ClientGone() from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", INVALID_REQUEST, "model", "model_not_found")

    async def _completion_prompt(self, prompt: Any) -> list[int]:
        prompt = _single_prompt(prompt)
        if isinstance(prompt, str):
            ids = await _tokenize(self.tokenizer.encode_prompt, prompt, len(prompt))
        else:
            ids = list(prompt)
            for i, t in enumerate(ids):
                if not 0 <= t < self.vocab_size:
                    raise invalid(f"token id {t} at position {i} is outside the vocabulary "
                                  f"[0, {self.vocab_size})", "prompt")
        if not ids:
            raise invalid("prompt must not be empty", "prompt")
        return ids

    async def _chat_prompt(self, messages: Any) -> list[int]:
        if messages is None:
            raise invalid("'messages' is a required property", "messages")
        size = sum(len(str(m.get("content", ""))) for m in messages
                   if isinstance(m, dict)) if isinstance(messages, list) else 0
        try:
            ids = await _tokenize(self.tokenizer.apply_chat_template, messages, size)
        except MessageError as e:
            raise invalid(str(e), e.param)
        except ValueError as e:
            raise invalid(str(e), "messages")
        if not ids:
            raise invalid("messages produced an empty prompt", "messages")
        return ids

    async def _prepare(self, request: Request, chat: bool, arrival: float) -> _Prepared:
        obj = await self._body(request)
        _check_union_fields(obj, chat)
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        try:
            req = model_cls.model_validate(obj)
        except ValidationError as e:
            raise _validation_error(e)
        self._check_model(req.model)
        _check_unsupported(req, chat)
        temperature = 1.0 if req.temperature is None else float(req.temperature)  # range: the model
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        stops = _parse_stop(req.stop)
        stream = bool(req.stream)
        if req.stream_options is not None and not stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)
        stop_ids = list(req.stop_token_ids or ())
        for t in stop_ids:
            if not 0 <= t < self.vocab_size:
                raise invalid(f"stop token id {t} is outside the vocabulary", "stop_token_ids")

        if chat:
            assert isinstance(req, ChatCompletionRequest)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
            mt_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        else:
            max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETIONS_MAX_TOKENS
            mt_param = "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise invalid(f"{mt_param} must be at least 1", mt_param)

        if chat:
            prompt_ids = await self._chat_prompt(obj["messages"])
            prompt_param = "messages"
        else:
            prompt_ids = await self._completion_prompt(obj["prompt"])
            prompt_param = "prompt"
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise invalid(f"This model's maximum context length is {self.max_model_len} tokens. "
                          f"However, your {prompt_param} has {n} tokens, which leaves no room "
                          f"for a completion.", prompt_param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.max_model_len - n
        elif n + max_tokens > self.max_model_len:
            raise invalid(f"This model's maximum context length is {self.max_model_len} tokens. "
                          f"However, you requested {n + max_tokens} tokens ({n} in the "
                          f"{prompt_param}, {max_tokens} in the completion). Please reduce the "
                          f"length of the {prompt_param} or completion.",
                          mt_param, "context_length_exceeded")

        sampling = SamplingParams(max_tokens=int(max_tokens), temperature=temperature, top_p=top_p,
                                  seed=req.seed, ignore_eos=bool(req.ignore_eos),
                                  stop_token_ids=tuple(stop_ids))
        prefix = "chatcmpl-" if chat else "cmpl-"
        return _Prepared(endpoint="chat.completions" if chat else "completions",
                         request_id=prefix + uuid.uuid4().hex, created=int(time.time()),
                         prompt_ids=prompt_ids, sampling=sampling, stops=stops, stream=stream,
                         include_usage=include_usage, cache_salt=req.cache_salt, arrival=arrival,
                         return_token_ids=bool(req.return_token_ids))

    # -- serving ------------------------------------------------------------------------

    async def handle(self, request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            p = await self._prepare(request, chat, arrival)
            greq = GenerationRequest(request_id=p.request_id, prompt_token_ids=p.prompt_ids,
                                     sampling=p.sampling, cache_salt=p.cache_salt,
                                     endpoint=p.endpoint, arrival_time=arrival)
            if p.stream:
                return await self._stream(request, p, greq, chat)
            return await self._complete(request, p, greq, chat)
        except APIError as e:
            return e.response()
        except BackendError as e:
            return _backend_error_response(e)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            log.exception("unexpected error serving %s", request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}: {e}", SERVER_ERROR)

    async def _complete(self, request: Request, p: _Prepared, greq: GenerationRequest,
                        chat: bool) -> Response:
        state = _TextState(self.tokenizer, p.stops, p.sampling.max_tokens)

        async def run() -> str:
            parts: list[str] = []
            agen = self.backend.generate(greq)
            try:
                it = agen.__aiter__()
                async for chunk in it:
                    parts.append(state.on_chunk(chunk))
                    if state.finish_reason is not None:
                        if state.backend_finished:
                            await _drain(it)
                        break
                else:
                    parts.append(state.on_end())
            finally:
                await _aclose(agen)
            return "".join(parts)

        async with _CancelOnDisconnect(request.receive):
            text = await run()
        usage = state.usage(len(p.prompt_ids))
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": state.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": state.finish_reason}
            obj = "text_completion"
        if p.return_token_ids:
            choice["token_ids"] = state.token_ids
            choice["prompt_token_ids"] = p.prompt_ids
        return JSONResponse({"id": p.request_id, "object": obj, "created": p.created,
                             "model": self.model_name, "choices": [choice], "usage": usage,
                             "system_fingerprint": None})

    async def _stream(self, request: Request, p: _Prepared, greq: GenerationRequest,
                      chat: bool) -> Response:
        state = _TextState(self.tokenizer, p.stops, p.sampling.max_tokens)
        agen = self.backend.generate(greq)
        aiter_ = agen.__aiter__()
        # Wait for the first chunk before committing to a 200, so that a BackendError raised
        # up front (429 overloaded, 503 no worker) keeps its status.
        async def first_chunk() -> GenerationChunk | None:
            try:
                return await aiter_.__anext__()
            except StopAsyncIteration:
                return None

        try:
            async with _CancelOnDisconnect(request.receive):
                first = await first_chunk()
        except BaseException:
            await _aclose(agen)
            raise

        obj_name = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": p.request_id, "object": obj_name, "created": p.created,
                "model": self.model_name}

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None,
                          "finish_reason": finish}
            out = dict(base, choices=[choice])
            if p.include_usage:
                out["usage"] = None
            return _sse(out)

        async def producer(emit: Callable[[bytes], Awaitable[None]]) -> None:
            try:
                if chat:
                    await emit(chunk("", None, role=True))
                try:
                    if first is None:
                        text = state.on_end()
                        if text:
                            await emit(chunk(text, None))
                    else:
                        text = state.on_chunk(first)
                        if text:
                            await emit(chunk(text, None))
                        if state.finish_reason is None:
                            async for c in aiter_:
                                text = state.on_chunk(c)
                                if text:
                                    await emit(chunk(text, None))
                                if state.finish_reason is not None:
                                    break
                            else:
                                text = state.on_end()
                                if text:
                                    await emit(chunk(text, None))
                        if state.backend_finished:
                            await _drain(aiter_)
                except Exception as e:
                    if isinstance(e, BackendError):
                        err = {"error": {"message": e.message, "type": e.type, "param": None,
                                         "code": e.code}}
                    else:
                        log.exception("unexpected error in stream %s", p.request_id)
                        err = {"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                         "type": SERVER_ERROR, "param": None, "code": None}}
                    await _aclose(agen)
                    await emit(_sse(err))
                    await emit(_SSE_DONE)
                    return
                await _aclose(agen)
                await emit(chunk(None if chat else "", state.finish_reason))
                if p.include_usage:
                    await emit(_sse(dict(base, choices=[], usage=state.usage(len(p.prompt_ids)))))
                await emit(_SSE_DONE)
            finally:
                await _aclose(agen)

        return _SSEResponse(producer)

    # -- models -------------------------------------------------------------------------

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "cpd", "root": self.model_name, "parent": None,
                "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "special_token_ids": sorted(self.tokenizer.special_ids)}


def _backend_error_response(e: BackendError) -> JSONResponse:
    status = e.status if 400 <= e.status <= 599 else 500
    return error_response(status, e.message, e.type or type_for_status(status), None,
                          getattr(e, "code", None), getattr(e, "retry_after_s", None))


# ----------------------------------------------------------------------------- app factory

def create_app(backend: GenerationBackend, tokenizer_dir: str, model_name: str,
               max_model_len: int, extra_routes: Iterable[Any] | None = None, *,
               tokenizer: Tokenizer | None = None, vocab_size: int | None = None,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> FastAPI:
    """Build the OpenAI-compatible FastAPI app.

    - ``backend``: produces tokens (:class:`~cpd.router.protocol.GenerationBackend`).
    - ``tokenizer_dir``: Hugging Face tokenizer folder, loaded with
      :func:`cpd.router.tokenization.load_tokenizer` (unless ``tokenizer`` is given).
    - ``model_name``: the only accepted ``model`` value (requests may omit ``model``).
    - ``max_model_len``: tokens; prompt + ``max_tokens`` must fit.
    - ``extra_routes``: optional iterable of ``fastapi.APIRouter`` (included) or Starlette
      routes (appended); they are registered *before* the built-in routes, so an extra
      ``/health`` replaces the default one. The caller may also add routes to the returned
      app.
    - ``vocab_size``: upper bound (exclusive) for prompt token ids; default ``len(tokenizer)``.
    - ``max_request_body_bytes``: larger bodies get 413 (default
      :data:`~cpd.router.request_body.DEFAULT_MAX_REQUEST_BODY_BYTES`, 16 MiB).

    ``GET /openapi.json`` describes the routes; the request schemas are the models that
    validate the bodies (:mod:`cpd.router.openapi`).

    The :class:`OpenAIFront` is available as ``app.state.front``.
    """
    tok = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
    front = OpenAIFront(backend, tok, model_name, max_model_len, vocab_size, max_request_body_bytes)
    app = FastAPI(title="cpd router", version="0.1.0", openapi_url="/openapi.json", docs_url=None,
                  redoc_url=None)
    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest})
    app.state.front = front

    @app.exception_handler(StarletteHTTPException)
    async def _http_exc(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if status == 404:
            msg = f"Unknown request URL: {request.method} {request.url.path}"
        typ = type_for_status(status) if status != 405 else INVALID_REQUEST
        return error_response(status, msg, typ, None, None)

    @app.exception_handler(RequestValidationError)
    async def _validation_exc(request: Request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(BackendError)
    async def _backend_exc(request: Request, exc: BackendError):
        return _backend_error_response(exc)

    @app.exception_handler(APIError)
    async def _api_exc(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(Exception)
    async def _any_exc(request: Request, exc: Exception):
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}", SERVER_ERROR)

    for r in extra_routes or ():
        if hasattr(r, "routes") and not hasattr(r, "path"):
            app.include_router(r)
        else:
            app.router.routes.append(r)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await front.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await front.handle(request, chat=True)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [front.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        if model != front.model_name:
            return error_response(404, f"The model '{model}' does not exist", INVALID_REQUEST,
                                  "model", "model_not_found")
        return front.model_card()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


__all__ = ["create_app", "OpenAIFront", "CompletionRequest", "ChatCompletionRequest",
           "StreamOptions", "DEFAULT_COMPLETIONS_MAX_TOKENS"]
