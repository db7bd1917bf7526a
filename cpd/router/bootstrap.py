"""What a standalone router (``cpd router``) must know before it serves: the KV namespace and
context of its workers (``[router] served``). ``cpd serve`` writes it; a router started on its
own learns it from a worker's ``GET /info`` — the one named by ``--served-from URL`` or the
first one of the static ``[router] workers`` list that answers (signed with the internal
secret when one is set). Every worker that joins later is still checked against it
(:mod:`cpd.router.compat`), so the first answer pins the namespace; set ``[router] served``
to pin it by hand.
"""
from __future__ import annotations

import logging
import time

import httpx

from cpd.auth import client_auth
from cpd.config import Config, ConfigError, ServedModel

log = logging.getLogger("cpd.router")


def learn_served(cfg: Config, served_from: str = "", secret: bytes | None = None,
                 timeout_s: float = 300.0, retry_s: float = 1.0) -> ServedModel:
    """``ServedModel`` from the first worker that answers ``GET /info`` within ``timeout_s``.
    Raises ConfigError when there is no worker to ask, or none answered."""
    urls = [u for u in [served_from, *(w.url for w in cfg.router.workers)] if u]
    if not urls:
        raise ConfigError("router.served is not set and there is no worker to learn it from: pass "
                          "--served-from http://WORKER:PORT, list [router] workers, or set [router.served]")
    deadline = time.monotonic() + timeout_s
    errors: dict[str, str] = {}
    with httpx.Client(timeout=5.0, auth=client_auth(secret)) as client:
        while time.monotonic() < deadline:
            for url in urls:
                try:
                    r = client.get(url.rstrip("/") + "/info")
                    r.raise_for_status()
                    info = r.json()
                    served = ServedModel(namespace=info["namespace"], max_model_len=info["max_model_len"],
                                         kv_bytes_per_token=info["kv_bytes_per_token"])
                    log.warning("KV namespace and context learned from %s: %s", url, served.namespace)
                    return served
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    if url not in errors:  # say what it waits for (it may wait minutes), once per worker
                        log.warning("router.served: waiting for %s to answer GET /info (%r); at most %.0f s",
                                    url, e, timeout_s)
                    errors[url] = repr(e)
            time.sleep(retry_s)
    raise ConfigError(f"router.served: no worker answered GET /info within {timeout_s:.0f} s: {errors}")


__all__ = ["learn_served"]
