"""The router's OpenAI-compatible HTTP front (package), independent of how tokens are produced.

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
penalty ∉ [-2, 2], min_p ∉ [0, 1], min_tokens > max_tokens     400     invalid_request_error
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

Modules, one concept each: :mod:`.models` (request models), :mod:`.validation` (checks the
models cannot state, error ``param`` paths), :mod:`.text_state` (detokenization, stop strings,
usage), :mod:`.sse` (event stream), :mod:`.cancel` (client disconnects), :mod:`.front` (request
handling), :mod:`.app` (app assembly). Tokenization glue is :mod:`cpd.router.tokenization`,
error bodies :mod:`cpd.router.errors`.
"""
from cpd.router.openai_front.app import create_app
from cpd.router.openai_front.front import OpenAIFront
from cpd.router.openai_front.models import (DEFAULT_COMPLETIONS_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                                            StreamOptions)

__all__ = ["create_app", "OpenAIFront", "CompletionRequest", "ChatCompletionRequest",
           "StreamOptions", "DEFAULT_COMPLETIONS_MAX_TOKENS"]
