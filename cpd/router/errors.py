"""OpenAI-style error objects for the router's HTTP front.

Every error response body is ``{"error": {"message": str, "type": str, "param": str|null,
"code": str|null}}`` — the shape of the OpenAI API reference ("Error codes" / error object),
which the official ``openai`` client parses into ``openai.APIStatusError`` subclasses.
"""
from __future__ import annotations

import math
import re
from typing import Any

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """An error to send to the client.

    - ``status``: HTTP status (400 invalid request, 404 unknown model/route, 429/503 from
      the backend, 500 internal).
    - ``message``: human-readable text.
    - ``type``: OpenAI error type (``invalid_request_error``, ``server_error``...).
    - ``param``: the request field at fault (dotted path, e.g. ``stream_options.include_usage``
      or ``messages[0].role``), or ``None``.
    - ``code``: machine-readable code (``context_length_exceeded``, ``model_not_found``...),
      or ``None``.
    - ``retry_after_s``: seconds; adds a ``Retry-After`` header (whole seconds, rounded up).
    """

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code,
                              self.retry_after_s)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The error object. Text that echoes client input is made valid Unicode (lone surrogates
    become U+FFFD), so rendering an error can never fail."""
    return {"error": {"message": _valid_unicode(message), "type": type, "param": _valid_unicode(param),
                      "code": code}}


def _valid_unicode(s: str | None) -> str | None:
    if s is None or s.isascii():
        return s
    return _SURROGATE.sub("\ufffd", s)


def retry_after_header(retry_after_s: float | None) -> dict[str, str]:
    """``{"Retry-After": "<int seconds>"}`` (at least 1), or ``{}``."""
    if retry_after_s is None:
        return {}
    try:
        secs = max(1, math.ceil(float(retry_after_s)))
    except (TypeError, ValueError, OverflowError):
        return {}
    return {"Retry-After": str(secs)}


def error_response(status: int, message: str, type: str = INVALID_REQUEST,
                   param: str | None = None, code: str | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status,
                        headers=retry_after_header(retry_after_s))


def type_for_status(status: int) -> str:
    """Default OpenAI error type for an HTTP status."""
    if status == 404:
        return NOT_FOUND
    if status == 429:
        return "rate_limit_exceeded"
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return SERVER_ERROR
    return INVALID_REQUEST


__all__ = ["APIError", "invalid", "error_body", "error_response", "retry_after_header",
           "type_for_status", "INVALID_REQUEST", "NOT_FOUND", "SERVER_ERROR"]
