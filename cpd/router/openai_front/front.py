"""The OpenAI front's request handling (:class:`OpenAIFront`): validate, tokenize (chat template
or prompt), hand a :class:`~cpd.router.protocol.GenerationRequest` to the backend, and answer
as one JSON body or as a server-sent event stream."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from cpd.messages.sampling import SamplingParams
from cpd.router.api_keys import current_tenant, effective_cache_salt
from cpd.router.errors import INVALID_REQUEST, SERVER_ERROR, APIError, error_response, invalid, type_for_status
from cpd.router.openai_front.cancel import CancelOnDisconnect, ClientGone, aclose_quietly
from cpd.router.openai_front.models import DEFAULT_COMPLETIONS_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from cpd.router.openai_front.sse import SSE_DONE, SSEResponse, sse_event
from cpd.router.openai_front.text_state import TextState, drain
from cpd.router.openai_front.validation import (check_union_fields, check_unsupported, check_unsupported_extensions,
                                                parse_stop, token_range, validation_error, without_token_prompt)
from cpd.router.protocol import BackendError, GenerationBackend, GenerationChunk, GenerationRequest
from cpd.router.request_body import DEFAULT_MAX_REQUEST_BODY_BYTES, ClientGoneWhileReading, read_json_body
from cpd.router.tokenization import MessageError, PromptTooLong, Tokenizer

log = logging.getLogger("cpd.router.openai_front")

_LONG_TEXT_CHARS = 4096  # tokenize longer inputs in a worker thread
_MANY_MESSAGES = 1000  # check chat bodies of more messages in a worker thread


@dataclass
class Prepared:
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


# Oversized inputs (OpenAIFront.oversized: more than the context can hold) are tokenized on threads
# of their own, so that however many arrive at once they only wait for each other, never hold up a
# prompt that may fit (the default executor's threads).
_OVERSIZED_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="cpd-oversized-prompt")


async def tokenize(fn: Callable[[Any], list[int]], arg: Any, size: int, oversized: bool = False) -> list[int]:
    """``fn(arg)``: here for short inputs, in a thread for long ones (``size`` characters), on the
    oversized inputs' own threads for ``oversized`` ones."""
    if oversized:
        return await asyncio.get_running_loop().run_in_executor(_OVERSIZED_POOL, fn, arg)
    if size > _LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, arg)
    return fn(arg)



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
        # Inputs that cannot fit the context: more characters than its tokens can stand for (a
        # generous 32 a token where the tokenizer gives no bound), or more chat messages than it
        # has tokens (every chat template writes at least a role marker per message).
        self.oversized_chars = self.max_model_len * (getattr(tokenizer, "max_token_bytes", None) or 32)
        self.oversized_messages = max(_MANY_MESSAGES, self.max_model_len)

    # -- request preparation ------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            return await read_json_body(request, self.max_request_body_bytes)
        except ClientGoneWhileReading:
            raise ClientGone() from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", INVALID_REQUEST, "model", "model_not_found")

    async def _completion_prompt(self, prompt: str | list[int], bounds: tuple[int, int] | None = None) -> list[int]:
        """``prompt``: the body's one prompt (:func:`single_prompt`); ``bounds``: its :func:`token_range`."""
        if isinstance(prompt, str):
            encode = functools.partial(self.tokenizer.encode_prompt, max_num_tokens=self.max_model_len - 1)
            try:
                ids = await tokenize(encode, prompt, len(prompt), len(prompt) > self.oversized_chars)
            except PromptTooLong as e:
                raise self._too_long("prompt", e) from None
        else:
            ids = list(prompt)
            lo, hi = bounds or token_range(ids) or (0, 0)
            if ids and (lo < 0 or hi >= self.vocab_size):  # C-level min/max; the loop names the first
                for i, t in enumerate(ids):
                    if not 0 <= t < self.vocab_size:
                        raise invalid(f"token id {t} at position {i} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", "prompt")
        if not ids:
            raise invalid("prompt must not be empty", "prompt")
        return ids

    async def _chat_prompt(self, messages: Any, cache_salt: str | None = None) -> list[int]:
        """Token ids of the chat ``messages``; the tokenizer's cache of long message pieces is scoped
        by the tenant and ``cache_salt`` (:meth:`Tokenizer.apply_chat_template`), as the KV cache is."""
        if messages is None:
            raise invalid("'messages' is a required property", "messages")
        size = sum(len(str(m.get("content", ""))) for m in messages
                   if isinstance(m, dict)) if isinstance(messages, list) else 0
        oversized = size > self.oversized_chars or (isinstance(messages, list)
                                                    and len(messages) > self.oversized_messages)
        scope = effective_cache_salt(current_tenant.get(), cache_salt)  # the namespace's salt: bounded
        try:
            ids = await tokenize(functools.partial(self.tokenizer.apply_chat_template, cache_scope=scope,
                                                   max_num_tokens=self.max_model_len - 1), messages, size, oversized)
        except PromptTooLong as e:
            raise self._too_long("messages", e) from None
        except MessageError as e:
            raise invalid(str(e), e.param)
        except ValueError as e:
            raise invalid(str(e), "messages")
        if not ids:
            raise invalid("messages produced an empty prompt", "messages")
        return ids

    def _too_long(self, param: str, e: PromptTooLong) -> APIError:
        """The context-length 400 of a prompt refused before it was tokenized (:class:`PromptTooLong`)."""
        return invalid(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                       f"{param} has at least {e.min_num_tokens} tokens, which leaves no room for a completion.",
                       param, "context_length_exceeded")

    @staticmethod
    def _validate(obj: dict[str, Any], chat: bool) -> tuple[str | list[int] | None, tuple[int, int] | None,
                                                           ChatCompletionRequest | CompletionRequest]:
        """The body's one completions prompt, its token range and the request model. Chat
        messages are checked once, by :func:`check_union_fields`; the model is given the first
        of them as a stand-in (as :func:`without_token_prompt` does for token ids)."""
        prompt = check_union_fields(obj, chat)
        bounds = token_range(prompt)
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        stand_in = {**obj, "messages": obj["messages"][:1]} if chat else without_token_prompt(obj, prompt, bounds)
        try:
            return prompt, bounds, model_cls.model_validate(stand_in)
        except ValidationError as e:
            raise validation_error(e)

    async def _prepare(self, request: Request, chat: bool, arrival: float) -> Prepared:
        obj = await self._body(request)
        messages = obj.get("messages") if chat else None
        if isinstance(messages, list) and len(messages) > _MANY_MESSAGES:  # per-message work off the event loop
            prompt, bounds, req = await asyncio.to_thread(self._validate, obj, chat)
        else:
            prompt, bounds, req = self._validate(obj, chat)
        self._check_model(req.model)
        check_unsupported(req, chat)
        check_unsupported_extensions(obj, chat)
        temperature = 1.0 if req.temperature is None else float(req.temperature)  # range: the model
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        stops = parse_stop(req.stop)
        stream = bool(req.stream)
        if req.stream_options is not None and not stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        include_usage = bool(stream and req.stream_options and req.stream_options.include_usage)
        stop_ids = sorted(set(req.stop_token_ids or ()))  # each once: a repeated id changes nothing
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
            prompt_ids = await self._chat_prompt(obj["messages"], req.cache_salt)
            prompt_param = "messages"
        else:
            assert prompt is not None  # check_union_fields returned the completions prompt
            prompt_ids = await self._completion_prompt(prompt, bounds)
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

        min_tokens = req.min_tokens or 0
        if min_tokens > max_tokens:
            raise invalid(f"min_tokens ({min_tokens}) must be at most {mt_param} ({max_tokens})", "min_tokens")
        sampling = SamplingParams(max_tokens=int(max_tokens), temperature=temperature, top_p=top_p,
                                  top_k=max(0, req.top_k or 0), min_p=req.min_p or 0.0,
                                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                                  presence_penalty=req.presence_penalty or 0.0,
                                  frequency_penalty=req.frequency_penalty or 0.0, min_tokens=min_tokens,
                                  seed=req.seed, ignore_eos=bool(req.ignore_eos),
                                  stop_token_ids=tuple(stop_ids))
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Prepared(endpoint="chat.completions" if chat else "completions",
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
            return backend_error_response(e)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            log.exception("unexpected error serving %s", request.url.path)
            return error_response(500, f"internal error: {type(e).__name__}: {e}", SERVER_ERROR)

    async def _complete(self, request: Request, p: Prepared, greq: GenerationRequest,
                        chat: bool) -> Response:
        state = TextState(self.tokenizer, p.stops, p.sampling.max_tokens, p.sampling.min_tokens)

        async def run() -> str:
            parts: list[str] = []
            agen = self.backend.generate(greq)
            try:
                it = agen.__aiter__()
                async for chunk in it:
                    parts.append(state.on_chunk(chunk))
                    if state.finish_reason is not None:
                        if state.backend_finished:
                            await drain(it)
                        greq.control.stop_matched = True
                        break
                else:
                    parts.append(state.on_end())
            finally:
                await aclose_quietly(agen)
            return "".join(parts)

        async with CancelOnDisconnect(request.receive):
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

    async def _stream(self, request: Request, p: Prepared, greq: GenerationRequest,
                      chat: bool) -> Response:
        state = TextState(self.tokenizer, p.stops, p.sampling.max_tokens, p.sampling.min_tokens)
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
            async with CancelOnDisconnect(request.receive):
                first = await first_chunk()
        except BaseException:
            await aclose_quietly(agen)
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
            return sse_event(out)

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
                            await drain(aiter_)
                except ClientGone:  # emit() after a disconnect: nobody to tell
                    raise
                except Exception as e:
                    if isinstance(e, BackendError):
                        err = {"error": {"message": e.message, "type": e.type, "param": None,
                                         "code": e.code}}
                    else:
                        log.exception("unexpected error in stream %s", p.request_id)
                        err = {"error": {"message": f"internal error: {type(e).__name__}: {e}",
                                         "type": SERVER_ERROR, "param": None, "code": None}}
                    await aclose_quietly(agen)
                    await emit(sse_event(err))
                    await emit(SSE_DONE)
                    return
                greq.control.stop_matched = state.finish_reason is not None  # complete here: closing is not a cancel
                await aclose_quietly(agen)
                await emit(chunk(None if chat else "", state.finish_reason))
                if p.include_usage:
                    await emit(sse_event(dict(base, choices=[], usage=state.usage(len(p.prompt_ids)))))
                await emit(SSE_DONE)
            finally:
                await aclose_quietly(agen)

        return SSEResponse(producer)

    # -- models -------------------------------------------------------------------------

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "cpd", "root": self.model_name, "parent": None,
                "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "special_token_ids": sorted(self.tokenizer.special_ids)}


def backend_error_response(e: BackendError) -> JSONResponse:
    status = e.status if 400 <= e.status <= 599 else 500
    return error_response(status, e.message, e.type or type_for_status(status), None,
                          getattr(e, "code", None), getattr(e, "retry_after_s", None))
