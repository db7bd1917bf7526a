"""Per-request output text: token count, incremental detokenization, stop strings, finish
reason and usage."""
from __future__ import annotations

import logging
from typing import Any

from cpd.router.detokenize import IncrementalDetokenizer, StopStringMatcher
from cpd.router.protocol import GenerationChunk
from cpd.router.tokenization import Tokenizer

log = logging.getLogger("cpd.router.openai_front")


class TextState:
    """Per-request output state: token count, detokenizer, stop strings, finish reason."""

    def __init__(self, tok: Tokenizer, stops: list[str], max_tokens: int, min_tokens: int = 0):
        self.detok = IncrementalDetokenizer(tok)
        self.stopper = StopStringMatcher(stops)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens  # text of the first min_tokens tokens is never matched (vLLM)
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
        exempt = ids[:max(0, self.min_tokens - self.completion_tokens)]
        self.completion_tokens += len(ids)
        self.token_ids.extend(ids)
        head = self.detok.push(exempt) if exempt else ""
        out, stopped = self.stopper.feed(self.detok.push(ids[len(exempt):]))
        out = head + out
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
        if self.completion_tokens <= self.min_tokens:
            rest = self.detok.flush()
            self.finish_reason = reason if reason in ("stop", "length") else "stop"
            return rest + self.stopper.flush()
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


async def drain(it: Any) -> None:
    """After a chunk with ``finish_reason``, let the backend generator run to its end (so
    code after its last ``yield`` runs, e.g. bookkeeping) instead of closing it at the yield.
    An extra chunk is ignored (the caller closes the generator afterwards)."""
    try:
        await it.__anext__()
    except StopAsyncIteration:
        pass
    except Exception:
        log.warning("backend generator failed after its final chunk", exc_info=True)
