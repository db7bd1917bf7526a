"""Internal authentication: a shared secret between the router and its workers.

Every call to a worker's internal HTTP API (``/prefill``, ``/decode``, ``/load``, ``/info``,
``/reset_prefix_cache``, ``/handoff/release``, ...) and every worker registration at the router
(``POST /cpd/register``) is signed with HMAC-SHA256 over the request:

    signature = HMAC(secret, METHOD "\\n" PATH "\\n" TIMESTAMP "\\n" SHA256(BODY))

sent as ``X-CPD-Timestamp`` (Unix seconds) and ``X-CPD-Signature`` (hex). A request without a
signature gets 401, a wrong signature or a timestamp more than ``max_skew_s`` away from the
receiver's clock gets 403 (both with an OpenAI-style error body). The secret itself never travels.
The KV handoff's TCP path authenticates each connection with a challenge–response over the same
secret (:func:`handoff_proof`).

Where the secret comes from: ``$CPD_INTERNAL_SECRET`` or a file (``--internal-secret-file``;
first line, surrounding whitespace dropped). No secret configured means no internal
authentication (one trusted host, as ``cpd serve`` on localhost has always been).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from typing import Awaitable, Callable, Iterable

import httpx
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("cpd.auth")

SECRET_ENV = "CPD_INTERNAL_SECRET"
TIMESTAMP_HEADER = "x-cpd-timestamp"
SIGNATURE_HEADER = "x-cpd-signature"
DEFAULT_MAX_SKEW_S = 300.0  # clocks of different hosts disagree; replays are bounded by this window
HANDOFF_NONCE_BYTES = 16
HANDOFF_PROOF_BYTES = 32


def load_secret(path: str | None = None, env: dict | None = None) -> bytes | None:
    """The shared secret from ``path`` (first line) or ``$CPD_INTERNAL_SECRET``; None if neither.
    Raises ValueError for an empty secret (a configured but empty secret is a mistake)."""
    if path:
        text = open(path, encoding="utf-8").read().splitlines()
        value = text[0].strip() if text else ""
        source = path
    else:
        found = (env if env is not None else os.environ).get(SECRET_ENV)
        source = f"${SECRET_ENV}"
        if found is None:
            return None
        value = found
        value = value.strip()
    if not value:
        raise ValueError(f"the internal secret in {source} is empty")
    return value.encode()


class AuthSection(BaseModel):
    """The ``[auth]`` section of the configuration (:mod:`cpd.config`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    api_keys: list[str] = Field(default_factory=list, description="accepted client keys (Authorization: Bearer "
                                                                   "KEY); none = no client authentication")
    api_key_files: list[str] = Field(default_factory=list, description="files of 'KEY [TENANT]' lines")
    open_paths: list[str] = Field(default_factory=lambda: ["/health", "/metrics"],
                                  description="router paths served without a key")
    internal_secret_file: str = Field("", description="file holding the router/worker shared secret "
                                                      "(default $CPD_INTERNAL_SECRET; none = unauthenticated)")
    max_skew_s: float = Field(DEFAULT_MAX_SKEW_S, gt=0, description="accepted clock difference of signed "
                                                                     "internal requests (seconds)")

    def secret(self) -> bytes | None:
        return load_secret(self.internal_secret_file or None)


def sign(secret: bytes, method: str, path: str, body: bytes, timestamp_s: float) -> str:
    """Hex HMAC-SHA256 of one request (see the module docstring)."""
    msg = b"\n".join([method.upper().encode(), path.encode(), str(int(timestamp_s)).encode(),
                      hashlib.sha256(body).hexdigest().encode()])
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def signed_headers(secret: bytes, method: str, path: str, body: bytes, now_s: float | None = None) -> dict:
    ts = int(time.time() if now_s is None else now_s)
    return {TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: sign(secret, method, path, body, ts)}


def verify(secret: bytes, method: str, path: str, body: bytes, timestamp: str | None, signature: str | None,
           now_s: float, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> tuple[int, str] | None:
    """None if the request is signed correctly, else ``(status, reason)``: 401 unsigned, 403 bad."""
    if not timestamp or not signature:
        return 401, "missing internal request signature (X-CPD-Timestamp / X-CPD-Signature)"
    try:
        ts = int(timestamp)
    except ValueError:
        return 403, "malformed X-CPD-Timestamp"
    if abs(now_s - ts) > max_skew_s:
        return 403, f"X-CPD-Timestamp is {now_s - ts:.0f} s away from this host's clock (limit {max_skew_s:.0f} s)"
    if not hmac.compare_digest(sign(secret, method, path, body, ts), signature):
        return 403, "invalid internal request signature (wrong shared secret?)"
    return None


class SignedAuth(httpx.Auth):
    """httpx auth flow that signs every request with the shared secret."""

    requires_request_body = True

    def __init__(self, secret: bytes):
        self.secret = secret

    def auth_flow(self, request: httpx.Request):
        request.headers.update(signed_headers(self.secret, request.method, request.url.path, request.content))
        yield request


def client_auth(secret: bytes | None) -> httpx.Auth | None:
    """What to pass as ``auth=`` to an httpx client talking to internal endpoints."""
    return SignedAuth(secret) if secret else None


def _error_body(status: int, message: str) -> bytes:
    typ = "authentication_error" if status == 401 else "permission_error"
    code = "missing_signature" if status == 401 else "invalid_signature"
    return json.dumps({"error": {"message": message, "type": typ, "param": None, "code": code}}).encode()


async def send_json_error(send: Callable[[dict], Awaitable[None]], status: int, body: bytes,
                          extra_headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            raise ConnectionAbortedError
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks)


class SignedRequestMiddleware:
    """ASGI middleware: every HTTP request to a path not in ``open_paths`` (and, when
    ``protected_paths`` is given, in it) must carry a valid signature; 401/403 otherwise,
    logged. The body is read once, verified and replayed to the app; later ``receive`` calls
    (client disconnect) go to the server as before."""

    def __init__(self, app, secret: bytes, open_paths: Iterable[str] = ("/health",),
                 protected_paths: Iterable[str] | None = None, max_skew_s: float = DEFAULT_MAX_SKEW_S):
        self.app = app
        self.secret = secret
        self.open_paths = frozenset(open_paths)
        self.protected_paths = frozenset(protected_paths) if protected_paths is not None else None
        self.max_skew_s = max_skew_s

    def _guards(self, path: str) -> bool:
        if path in self.open_paths:
            return False
        return self.protected_paths is None or path in self.protected_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self._guards(scope["path"]):
            return await self.app(scope, receive, send)
        try:
            body = await _read_body(receive)
        except ConnectionAbortedError:
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        bad = verify(self.secret, scope["method"], scope["path"], body, headers.get(TIMESTAMP_HEADER),
                     headers.get(SIGNATURE_HEADER), time.time(), self.max_skew_s)
        if bad is not None:
            client = scope.get("client") or ("?", 0)
            log.warning("refused internal request %s %s from %s:%s: %s", scope["method"], scope["path"],
                        client[0], client[1], bad[1])
            return await send_json_error(send, bad[0], _error_body(*bad))
        replayed = {"done": False}

        async def replay():
            if not replayed["done"]:
                replayed["done"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)


def handoff_proof(secret: bytes, nonce: bytes) -> bytes:
    """What a handoff receiver answers to a sender's connection challenge ``nonce``."""
    return hmac.new(secret, b"cpd-handoff\n" + nonce, hashlib.sha256).digest()


__all__ = ["AuthSection", "SECRET_ENV", "load_secret", "sign", "signed_headers", "verify", "SignedAuth", "client_auth",
           "SignedRequestMiddleware", "handoff_proof", "send_json_error"]
