"""``GET /openapi.json``: the router's OpenAPI 3.1 document, generated from the request models.

The completion endpoints read their body by hand (size limit, nesting and Unicode checks,
:mod:`cpd.router.request_body`) and then validate it with pydantic models, so FastAPI cannot see
the body schema on its own. :func:`install_openapi` generates the document from the routes and
puts each endpoint's request model (the same class that validates its bodies) in as the
``requestBody`` schema, and the OpenAI error object as every error response. One source: change
the model, the document follows.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
_ERROR_STATUSES = {"400": "invalid request (OpenAI error body; `param` names the field)",
                   "404": "unknown model (`code: model_not_found`)",
                   "413": "request body larger than the router's limit (`code: request_too_large`)",
                   "429": "too many requests in flight (`Retry-After`)",
                   "503": "no worker can serve now (`Retry-After` where known)"}


class ErrorObject(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every error body (OpenAI API reference, error object)."""

    error: ErrorObject


def install_openapi(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve ``app``'s document with ``bodies`` (path of a POST route → request model) as the
    request schemas. Built once, at the first request (routes added later are included)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_document(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_document(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible API of the cpd router")
    mode: Literal["validation", "serialization"] = "validation"
    schemas: list[type[BaseModel]] = [*bodies.values(), ErrorResponse]
    models = [(m, mode) for m in schemas]
    _, defs = models_json_schema(models, ref_template=_REF)
    doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    error = {"content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
    for path, model in bodies.items():
        op = doc["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=model.__name__)}}}}
        op["responses"] = {"200": {"description": "the completion (JSON), or server-sent events "
                                                  "when `stream` is true"},
                           **{s: {"description": d, **error} for s, d in _ERROR_STATUSES.items()}}
    return doc


__all__ = ["install_openapi", "build_document", "ErrorResponse"]
