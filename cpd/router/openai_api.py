"""Kept import path of the router's OpenAI front; the code lives in :mod:`cpd.router.openai_front`
(one module per concept)."""
from cpd.router.openai_front import (DEFAULT_COMPLETIONS_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                                     OpenAIFront, StreamOptions, create_app)

__all__ = ["create_app", "OpenAIFront", "CompletionRequest", "ChatCompletionRequest",
           "StreamOptions", "DEFAULT_COMPLETIONS_MAX_TOKENS"]
