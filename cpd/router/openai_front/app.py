"""Assembly of the OpenAI-compatible FastAPI app: routes, error handlers, OpenAPI document."""
from __future__ import annotations

import logging
from typing import Any, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpd.router.detokenize import prepare_detokenizer
from cpd.router.errors import INVALID_REQUEST, SERVER_ERROR, APIError, error_response, type_for_status
from cpd.router.openai_front.front import OpenAIFront, backend_error_response
from cpd.router.openai_front.models import ChatCompletionRequest, CompletionRequest
from cpd.router.openai_front.validation import validation_error
from cpd.router.openapi import install_openapi
from cpd.router.protocol import BackendError, GenerationBackend
from cpd.router.request_body import DEFAULT_MAX_REQUEST_BODY_BYTES
from cpd.router.tokenization import Tokenizer, load_tokenizer

log = logging.getLogger("cpd.router.openai_front")


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
    prepare_detokenizer(tok)  # its one-time work at start-up, not in the first request's TTFT
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
        return validation_error(exc).response()

    @app.exception_handler(BackendError)
    async def _backend_exc(request: Request, exc: BackendError):
        return backend_error_response(exc)

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
