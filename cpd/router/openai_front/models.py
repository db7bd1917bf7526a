"""Request models of the OpenAI front (pydantic): they validate every body (types and
ranges) and ``GET /openapi.json`` is generated from them."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

DEFAULT_COMPLETIONS_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``; chat defaults to the rest of the
context (``max_model_len - prompt_tokens``)."""
MAX_STOP_STRINGS = 4
SEED_RANGE = (-(2 ** 63), 2 ** 64)


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


class CommonRequest(BaseModel):
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
    presence_penalty: Optional[Annotated[StrictFloat, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]] = None
    frequency_penalty: Optional[Annotated[StrictFloat, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]] = None
    top_k: Optional[Annotated[StrictInt, Field(ge=-1)]] = Field(None, description="vLLM extension: -1 or 0 disables")
    min_p: Optional[Annotated[StrictFloat, Field(ge=0.0, le=1.0, allow_inf_nan=False)]] = None  # vLLM extension
    repetition_penalty: Optional[Annotated[StrictFloat, Field(gt=0.0, allow_inf_nan=False)]] = None  # vLLM
    min_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = None  # vLLM extension
    logit_bias: Any = Field(None, description="unsupported")


class CompletionRequest(CommonRequest):
    """Body of ``POST /v1/completions`` (OpenAI "Create completion"). ``prompt``: text, token
    ids, or a batch of exactly one of either."""

    prompt: Union[Annotated[StrictStr, Field(min_length=1)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]]
    echo: Optional[StrictBool] = Field(None, description="unsupported: only false")
    best_of: Optional[StrictInt] = Field(None, description="unsupported: only 1")
    suffix: Any = Field(None, description="unsupported")


class ChatCompletionRequest(CommonRequest):
    """Body of ``POST /v1/chat/completions`` (OpenAI "Create chat completion")."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    tools: Any = Field(None, description="unsupported")
    tool_choice: Any = Field(None, description="unsupported: only 'none'")
    response_format: Any = Field(None, description="only {'type': 'text'}")
