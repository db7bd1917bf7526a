"""Reading a request's JSON body safely: bounded size, bounded nesting, valid Unicode.

Everything the router does later with a body (tokenize strings, hash salts, echo a model name
in an error, forward fields to workers as UTF-8 JSON) assumes that the body is a JSON object of
modest size whose strings are valid Unicode. :func:`read_json_body` makes that true or answers
with the OpenAI error body:

================================================  ======  =================================
condition                                         status  code
================================================  ======  =================================
``Content-Length`` or the streamed body exceeds   413     ``request_too_large``
``max_body_bytes``
not UTF-8 / not JSON / not a JSON object          400     ``None``
nested deeper than :data:`MAX_JSON_DEPTH`         400     ``json_nesting_too_deep``
a string or key with a lone UTF-16 surrogate      400     ``invalid_unicode``
(``"\\ud800"`` escapes; ``param`` = where)
================================================  ======  =================================

The size limit is enforced on the bytes actually received (a chunked body or a lying
``Content-Length`` cannot get past it), and the body is not read further once it is exceeded.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from cpd.router.errors import INVALID_REQUEST, APIError, invalid

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 << 20
"""16 MiB: room for a 128k-token prompt as text or as a token-id list with chat overhead,
small enough that a few concurrent bodies cannot exhaust the router's memory."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of objects/arrays accepted (an OpenAI chat body needs about 6)."""
_PARSE_IN_THREAD_BYTES = 1 << 20  # parse larger bodies off the event loop
_SCALARS = frozenset({int, float, bool, type(None)})  # JSON values with no string or nesting in them
_SCAN_IN_C_ITEMS = 64  # longer lists are first checked for holding only _SCALARS (one C-level pass)


class BodyTooLarge(APIError):
    """413. The response closes the connection (``Connection: close``): the rest of the body is
    never read, so the connection cannot carry another request, and a client that keeps sending
    is cut off rather than drained."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body is larger than the limit of {max_bytes} bytes",
                         INVALID_REQUEST, None, "request_too_large")

    def response(self) -> JSONResponse:
        r = super().response()
        r.headers["Connection"] = "close"
        return r


class ClientGoneWhileReading(Exception):
    """The client disconnected before its body was complete."""


async def read_limited(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` (else :class:`BodyTooLarge`, without reading on)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(max_bytes)
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge(max_bytes)
            parts.append(chunk)
    except ClientDisconnect as e:
        raise ClientGoneWhileReading() from e
    return b"".join(parts)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object whose nesting and strings are safe (see module docstring).

    msgspec decodes first (3x faster than :func:`json.loads` on a long token-id list); whatever it
    refuses (not UTF-8, NaN/Infinity, a lone surrogate escape, too deep for it, malformed) is decoded
    again by :func:`json.loads`, whose result or error is the answer, so every accepted body gives
    the same object and every refused one the same error as with :func:`json.loads` alone."""
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        obj = _json_loads(raw)
    if not isinstance(obj, dict):
        raise invalid("request body must be a JSON object")
    check_tree(obj)
    return obj


def _json_loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise invalid(f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                      code="json_nesting_too_deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"request body is not valid JSON: {e}") from None


async def read_json_body(request: Request, max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> dict[str, Any]:
    raw = await read_limited(request, max_bytes)
    if len(raw) > _PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json_object, raw)
    return parse_json_object(raw)


def check_tree(obj: Any) -> None:
    """Raise a 400 if ``obj`` nests deeper than :data:`MAX_JSON_DEPTH` or holds a string (value
    or key) with a lone surrogate. Iterative: never recurses, whatever the input."""
    stack: list[tuple[Any, int, tuple]] = [(obj, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                          _param(path), "json_nesting_too_deep")
        if type(node) is list and len(node) > _SCAN_IN_C_ITEMS and _SCALARS.issuperset(map(type, node)):
            continue  # a long list of numbers (token ids): nothing in it to check, no Python loop
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and _has_surrogate(key):
                raise _surrogate_error(path)
            if isinstance(value, str):
                if _has_surrogate(value):
                    raise _surrogate_error(path + (key,))
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, path + (key,)))


def _has_surrogate(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_error(path: tuple) -> APIError:
    return invalid("strings must be valid Unicode: a lone UTF-16 surrogate (\\ud800-\\udfff "
                   "without its pair) is not allowed", _param(path), "invalid_unicode")


def _param(path: tuple) -> str | None:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or None


__all__ = ["read_json_body", "read_limited", "parse_json_object", "check_tree", "BodyTooLarge",
           "ClientGoneWhileReading", "DEFAULT_MAX_REQUEST_BODY_BYTES", "MAX_JSON_DEPTH"]
