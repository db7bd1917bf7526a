"""Contract between the router's OpenAI-compatible HTTP front and whatever produces tokens.

The front (:mod:`cpd.router.openai_front`) validates a request, turns it into token ids and
hands a :class:`GenerationRequest` to a :class:`GenerationBackend`. The backend yields
:class:`GenerationChunk` values (new token ids, in order) until it sets ``finish_reason``.
The front owns everything textual: detokenization, stop strings, the OpenAI wire format.
The backend owns everything about tokens: routing, sampling, EOS, ``max_tokens``.

End of a request: after a chunk with ``finish_reason`` set, the front pulls once more, so
the generator should simply return (its code after the last ``yield`` runs normally; a
further chunk would be ignored and the generator closed).

Cancellation: the front *closes* the async generator returned by
:meth:`GenerationBackend.generate` (``await agen.aclose()``, or by cancelling the task that
is iterating it) when it no longer wants tokens — a stop string matched, the client
disconnected, or an error happened. A backend must treat that as "cancel this request on
every worker and free its blocks" (docs/architecture.md 'Fallbacks': client disconnects → work is
cancelled). Put the cancellation in a ``try/finally`` inside the generator; the ``finally``
runs on ``aclose()`` (``GeneratorExit``) and on task cancellation (``CancelledError``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

from cpd.messages.sampling import SamplingParams

FINISH_REASONS = ("stop", "length")


@dataclass
class GenerationRequest:
    """One request as the backend sees it.

    - ``request_id``: ``cmpl-<32 hex>`` or ``chatcmpl-<32 hex>``; the same id the client
      sees in the response ``id``.
    - ``prompt_token_ids``: the full prompt (chat template already applied), each id in
      ``[0, vocab_size)``, ``1 <= len < max_model_len``.
    - ``cache_salt``: tenant salt for the block-hash namespace (vLLM extension field); two
      requests with different salts never share KV blocks.
    - ``endpoint``: ``"completions"`` or ``"chat.completions"`` (for metrics / logs).
    - ``arrival_time``: ``time.monotonic()`` seconds when the HTTP request arrived at the
      router (for TTFT accounting).
    - ``sampling``: the one sampling type (:class:`cpd.messages.sampling.SamplingParams`),
      validated by its constructor; ``max_tokens`` is always set by the front.
    - ``control``: state the front shares with the backend while the request runs (shared by
      copies made with ``dataclasses.replace``, e.g. by the tenant wrapper).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    endpoint: str = "completions"
    arrival_time: float | None = None
    control: "RequestControl" = field(default_factory=lambda: RequestControl())


@dataclass
class RequestControl:
    """Mutable per-request state shared by the front and the backend.

    - ``stop_matched``: set by the front just before it closes the generator because the
      request is complete on its side (a stop string matched): the close then ends a finished
      request, not a cancelled one (metrics count it ``ok``).
    """

    stop_matched: bool = False


@dataclass
class GenerationChunk:
    """Some new tokens of one request.

    - ``token_ids``: newly generated ids, in order (may be empty, e.g. on a final chunk
      that only carries ``finish_reason``).
    - ``finish_reason``: ``None`` while running; ``"stop"`` (EOS or a stop token id) or
      ``"length"`` (``max_tokens`` reached) on the last chunk.
    - ``num_cached_tokens``: set on the first chunk: how many prompt tokens had their KV
      loaded from a tier (L1/L2/L3) instead of being computed. Reported to the client as
      ``usage.prompt_tokens_details.cached_tokens``.
    """

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None


@runtime_checkable
class GenerationBackend(Protocol):
    """Produces tokens for a request.

    ``generate`` is an ``async def`` generator function (or returns any async iterator
    with ``aclose``). It may raise :class:`BackendError` — before the first chunk (the
    front turns it into that HTTP status) or later (the front reports it inside the
    stream). Closing the iterator must cancel the request everywhere.
    """

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        ...


class BackendError(Exception):
    """A failure the client should see with a specific HTTP status.

    - ``status``: HTTP status, e.g. ``503`` (no worker of a needed role is alive),
      ``429`` (overloaded: admission control rejected the request), ``500``.
    - ``message``: human-readable reason (sent to the client).
    - ``type``: OpenAI-style error type, e.g. ``"service_unavailable"``,
      ``"rate_limit_exceeded"``, ``"server_error"``.
    - ``code``: optional machine-readable code.
    - ``retry_after_s``: seconds; if set, the front sends a ``Retry-After`` header
      (rounded up to whole seconds, RFC 9110 §10.2.3).
    """

    def __init__(self, message: str, status: int = 503, type: str = "service_unavailable",
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type
        self.code = code
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return (f"BackendError(status={self.status}, type={self.type!r}, "
                f"message={self.message!r}, retry_after_s={self.retry_after_s})")


__all__ = ["GenerationRequest", "GenerationChunk", "GenerationBackend",
           "BackendError", "FINISH_REASONS"]
