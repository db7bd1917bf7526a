"""Credentials and TLS of a Redis store URL (issue 12 §3).

``redis://[USER[:PASSWORD]@]HOST:PORT[/DB]`` (ACL user and password, or ``:PASSWORD@`` for
``requirepass``), ``rediss://...`` (TLS) and the cluster forms ``redis+cluster://`` /
``rediss+cluster://``. TLS options come from the query: ``ssl_ca_certs=PATH`` (CA bundle; default:
the system's), ``ssl_certfile=PATH`` and ``ssl_keyfile=PATH`` (client certificate for mutual TLS),
``ssl_cert_reqs=required|optional|none`` (default required), ``ssl_check_hostname=0|1`` (default 1).
Percent-escapes in the user and password are decoded. :func:`connection_kwargs` turns a parsed URL
into keyword arguments of ``redis.Redis`` / ``redis.cluster.RedisCluster`` (and of the eviction
watcher's own connections); the password never appears in the store's ``url`` (logs, errors).
"""
from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import SplitResult, unquote

_TRUE = {"1", "true", "yes", "on"}
_CERT_REQS = {"required", "optional", "none"}


def is_tls(scheme: str) -> bool:
    return scheme in ("rediss", "rediss+cluster")


def connection_kwargs(u: SplitResult, query: Mapping[str, str]) -> dict[str, Any]:
    """``username``/``password`` from the URL's user part, ``ssl*`` options for ``rediss``.
    Raises ValueError for an unknown ``ssl_cert_reqs``."""
    kw: dict[str, Any] = {}
    userinfo, at, _ = u.netloc.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        if colon:
            kw["password"] = unquote(password)
            if user:
                kw["username"] = unquote(user)
        elif user:  # "redis://secret@host": a password alone, as redis-py reads it
            kw["password"] = unquote(user)
    if is_tls(u.scheme):
        reqs = query.get("ssl_cert_reqs", "required").lower()
        if reqs not in _CERT_REQS:
            raise ValueError(f"ssl_cert_reqs must be one of {sorted(_CERT_REQS)}, got {reqs!r}")
        kw.update(ssl=True, ssl_cert_reqs=reqs,
                  ssl_check_hostname=query.get("ssl_check_hostname", "1").lower() in _TRUE and reqs != "none")
        for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if query.get(k):
                kw[k] = query[k]
    return kw


__all__ = ["connection_kwargs", "is_tls"]
