"""Client authentication at the router's front door, and the tenant each API key stands for.

Keys: ``--api-key KEY`` (repeatable) and ``--api-key-file FILE`` (one key per line, optionally
followed by whitespace and a tenant name: ``KEY [TENANT]``; blank lines and ``#`` comments are
skipped). A key given without a tenant name is its own tenant, named by a hash of the key.

Requests carry ``Authorization: Bearer KEY`` (OpenAI style). With at least one key configured,
every route except ``open_paths`` (default ``/health`` and ``/metrics``) and the routes that
authenticate themselves (``/cpd/register``, signed with the internal secret) answers 401 with
the OpenAI error body when the key is missing or unknown. No keys configured: no client
authentication and no tenants (one trusted client population).

Tenants (docs/architecture.md "Tenants"): the tenant of the authenticated key goes into the block-hash
namespace's salt, server side; a body ``cache_salt`` can only add to it
(:func:`effective_cache_salt`). Two keys of different tenants therefore never share a KV block
in any tier, whatever salts their bodies carry. The tenant travels from the middleware to the
backend in a context variable (:data:`current_tenant`), set for the duration of the request;
:class:`TenantScopedBackend` applies it to every request it passes on.
"""
from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Iterable

from cpd.auth import send_json_error
from cpd.router.protocol import GenerationBackend, GenerationChunk, GenerationRequest

log = logging.getLogger("cpd.router.auth")

DEFAULT_OPEN_PATHS = ("/health", "/metrics")
SELF_AUTHENTICATED_PATHS = ("/cpd/register", "/cpd/role")  # signed with the internal secret instead

current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("cpd_tenant", default=None)


def tenant_of_key(key: str) -> str:
    """Default tenant name of a key: a hash (the key itself never appears in salts or logs)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ApiKeys:
    """Accepted keys, each mapped to its tenant. Lookups go by SHA-256 of the key."""

    tenant_by_key_hash: dict[bytes, str]

    @property
    def enabled(self) -> bool:
        return bool(self.tenant_by_key_hash)

    def tenant(self, key: str) -> str | None:
        """The tenant of ``key``, or None if it is not accepted."""
        return self.tenant_by_key_hash.get(hashlib.sha256(key.encode()).digest())

    @classmethod
    def build(cls, keys: Iterable[str] = (), key_files: Iterable[str] = ()) -> "ApiKeys":
        table: dict[bytes, str] = {}
        pairs: list[tuple[str, str | None]] = [(k, None) for k in keys]
        for path in key_files:
            pairs += parse_key_file(open(path, encoding="utf-8").read(), path)
        for key, tenant in pairs:
            if not key:
                raise ValueError("an API key is empty")
            digest, tenant = hashlib.sha256(key.encode()).digest(), tenant or tenant_of_key(key)
            if table.setdefault(digest, tenant) != tenant:  # which tenant's KV would it read?
                raise ValueError(f"an API key is given twice, for tenants {table[digest]!r} and {tenant!r}")
        return cls(table)


def parse_key_file(text: str, source: str = "<keys>") -> list[tuple[str, str | None]]:
    """``KEY [TENANT]`` per line; raises ValueError naming the line for anything else."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{source}:{i}: expected 'KEY [TENANT]', got {len(parts)} fields")
        out.append((parts[0], parts[1] if len(parts) == 2 else None))
    return out


MAX_PLAIN_SALT_CHARS = 128
"""Longer namespace salts are replaced by :data:`SALT_DIGEST_PREFIX` + their SHA-256 (:func:`compact_salt`)."""
SALT_DIGEST_PREFIX = "sha256:"


def compact_salt(salt: str) -> str:
    """``salt`` itself when it has at most :data:`MAX_PLAIN_SALT_CHARS` characters, else its digest
    form (``sha256:`` + 64 hex digits). The salt only tells namespaces apart, but every cache
    keyed by namespace (root hashes, the tokenizer's pieces) and every worker call carried it
    whole: a client's distinct 1 MB salts each stayed in the router's and the workers' memory. A
    short salt that starts with the prefix is hashed too, so that no salt ever equals another's
    digest form: distinct salts stay distinct (up to SHA-256 collisions)."""
    if len(salt) <= MAX_PLAIN_SALT_CHARS and not salt.startswith(SALT_DIGEST_PREFIX):
        return salt
    return SALT_DIGEST_PREFIX + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()


def effective_cache_salt(tenant: str | None, body_salt: str | None) -> str | None:
    """The namespace salt of a request: the authenticated tenant, narrowed by the body's salt.
    Without a tenant (no keys configured) the body's salt is used as given. The encoding is
    unambiguous: no (tenant, body salt) pair produces another pair's salt. Long salts are kept
    as their digest (:func:`compact_salt`)."""
    if tenant is None:
        return None if body_salt is None else compact_salt(body_salt)
    return compact_salt(json.dumps(["tenant", tenant, body_salt], separators=(",", ":")))


def _unauthorized(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


def _bearer(scope) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == b"authorization":
            scheme, _, token = v.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class ApiKeyMiddleware:
    """ASGI middleware: check ``Authorization: Bearer`` and set :data:`current_tenant`."""

    def __init__(self, app, keys: ApiKeys, open_paths: Iterable[str] = DEFAULT_OPEN_PATHS):
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths) | frozenset(SELF_AUTHENTICATED_PATHS)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        key = _bearer(scope)
        tenant = self.keys.tenant(key) if key else None
        if tenant is None:
            msg = ("You didn't provide an API key. You need to provide your API key in an Authorization "
                   "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)." if key is None
                   else "Incorrect API key provided.")
            return await send_json_error(send, 401, _unauthorized(msg), [(b"www-authenticate", b"Bearer")])
        token = current_tenant.set(tenant)
        try:
            return await self.app(scope, receive, send)
        finally:
            current_tenant.reset(token)


class TenantScopedBackend:
    """Wraps the generation backend: each request's ``cache_salt`` becomes
    :func:`effective_cache_salt` of the current tenant and the body's salt."""

    def __init__(self, inner: GenerationBackend):
        self.inner = inner

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        salt = effective_cache_salt(current_tenant.get(), req.cache_salt)
        return self.inner.generate(dataclasses.replace(req, cache_salt=salt))

    def __getattr__(self, name):  # everything else (recent records, counters) is the inner backend's
        return getattr(self.inner, name)


__all__ = ["ApiKeys", "ApiKeyMiddleware", "TenantScopedBackend", "effective_cache_salt", "compact_salt", "parse_key_file",
           "tenant_of_key", "current_tenant", "DEFAULT_OPEN_PATHS"]
