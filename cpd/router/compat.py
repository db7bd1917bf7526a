"""Worker admission: the router uses a worker only if its KV and its context fit the deployment.

Why (docs/architecture.md, Terms: "namespace"): the router hashes a prompt's blocks with the deployment's namespace
(model id, weights digest, tokenizer digest, adapter, block size, KV dtype and layout). A worker
whose engine hashes with another namespace never holds the blocks the router predicts, so every
predicted hit on it is a miss, and each miss deletes valid index entries. A worker whose
``max_model_len`` is below the router's limit would end requests the router admitted early
(``finish_reason: "length"``): silent truncation. Neither may be routed to.

How: each worker answers ``GET /info`` (role, namespace, ``max_model_len``, ``boot_id``).
:func:`refusal_reason` (pure) compares it with the deployment's :class:`Requirements` and the
role the router config gives the worker. :func:`admit` fetches and applies the verdict to the
:class:`~cpd.router.workers.WorkerInfo`: ``state`` becomes ``"accepted"`` or ``"refused"``
(with ``refusal_reason``); a refused worker is never routed to (its snapshot reads unhealthy)
and shows in ``/cpd/workers``, ``/health`` and the router log.

When: the router's poller calls :func:`admit` when it first reaches a worker, when a worker
comes back after being unhealthy, when the ``boot_id`` in its ``/load`` changes (it restarted,
maybe with other settings), and on every poll while it is refused (a worker restarted with the
right settings is accepted without restarting the router). See :func:`needs_check`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import msgspec

from cpd.kv.block_hash import Namespace
from cpd.messages.worker_api import WorkerInfoReport, decode_body
from cpd.router.workers import WorkerInfo
from cpd.types import PREFILL_SIDE_ROLES

log = logging.getLogger("cpd.router")

INFO_TIMEOUT_S = 5.0
ACCEPTED, REFUSED, UNCHECKED = "accepted", "refused", "unchecked"


@dataclass(frozen=True)
class Requirements:
    """What every worker of a deployment must match.

    - ``namespace``: the router's KV namespace (without tenant salt); every field must be equal.
    - ``max_model_len``: tokens (prompt + output) the router admits per request; a worker must
      hold at least this many.
    """

    namespace: Namespace
    max_model_len: int


def refusal_reason(info: dict[str, Any], role: str, req: Requirements) -> str | None:
    """Why a worker reporting ``info`` (its ``GET /info``) cannot serve as ``role`` in a
    deployment with requirements ``req``; ``None`` when it can. Pure.

    A worker reporting the *other* prefill-side role (pre-prefill <-> prefill) is not refused:
    elastic roles change them at run time (``POST /role``), so a router restarted from its
    config, or a worker restarted from its command line, may disagree with the other side; the
    caller adopts the worker's role (:func:`reported_role_swap`)."""
    if info.get("role") != role and reported_role_swap(info, role) is None:
        return f"role is {info.get('role')!r} but the router config lists it as {role!r}"
    theirs = info.get("namespace")
    if not isinstance(theirs, dict):
        return "reports no KV namespace"
    ours = dataclasses.asdict(req.namespace)
    diffs = [f"{k}={theirs.get(k)!r} (deployment: {ours.get(k)!r})"
             for k in sorted(set(ours) | set(theirs)) if theirs.get(k) != ours.get(k)]
    if diffs:
        return "KV namespace differs: " + ", ".join(diffs)
    n = info.get("max_model_len")
    if not isinstance(n, int) or n < req.max_model_len:
        return (f"max_model_len {n} is below the router's limit of {req.max_model_len} tokens "
                f"(requests the router admits would be cut short)")
    return None


def reported_role_swap(info: dict[str, Any], role: str) -> str | None:
    """The role ``info`` reports when it is the other prefill-side role than ``role`` (an elastic
    change the router did not see); None otherwise. Pure."""
    reported = info.get("role")
    sides = {str(r) for r in PREFILL_SIDE_ROLES}
    return reported if reported != role and reported in sides and role in sides else None


def needs_check(w: WorkerInfo, was_healthy: bool) -> bool:
    """After a good poll of ``w`` (``w.last_load`` fresh): must the router (re)check it?"""
    if w.state != ACCEPTED or not was_healthy:
        return True
    boot_id = (w.last_load or {}).get("boot_id")
    return boot_id is not None and boot_id != w.boot_id


async def fetch_info(client: httpx.AsyncClient, w: WorkerInfo) -> dict[str, Any]:
    """``GET /info`` of ``w``, decoded through :class:`cpd.messages.worker_api.WorkerInfoReport`
    and returned as plain JSON values. Raises ``httpx.HTTPError`` (transport or HTTP status) or
    ``ValueError`` (:class:`~cpd.messages.worker_api.MalformedBody`: not that message)."""
    r = await client.get(f"{w.url}/info", timeout=INFO_TIMEOUT_S)
    r.raise_for_status()
    return msgspec.to_builtins(decode_body(r.content, WorkerInfoReport))


async def admit(client: httpx.AsyncClient, w: WorkerInfo, req: Requirements,
                on_role_swap: Callable[[WorkerInfo, str], None] | None = None) -> bool:
    """Check ``w`` and record the verdict on it; True if it is accepted. A worker that cannot
    be reached stays unchecked (not routed to; checked again at its next good poll); one that
    answers without a usable ``/info`` is refused. An accepted worker reporting the other
    prefill-side role (:func:`reported_role_swap`) is given that role through ``on_role_swap``
    (the router's :meth:`~cpd.router.workers.WorkerSet.set_role`: logged and counted), else
    directly."""
    try:
        info = await fetch_info(client, w)
    except httpx.TransportError as e:
        log.warning("worker %s: cannot check compatibility yet (%r)", w.worker_id, e)
        w.state = UNCHECKED
        return False
    except (httpx.HTTPError, ValueError) as e:
        record(w, f"GET /info failed: {e!r}", None)
        return False
    reason = refusal_reason(info, w.role, req)
    swap = reported_role_swap(info, w.role) if reason is None else None
    if swap is not None:
        if on_role_swap is not None:
            on_role_swap(w, swap)
        else:
            w.role = swap
    record(w, reason, info)
    return reason is None


def record(w: WorkerInfo, reason: str | None, info: dict[str, Any] | None) -> None:
    """Set ``w``'s state from a verdict; log when the verdict changes."""
    if info is not None:
        w.boot_id = info.get("boot_id")
        n = info.get("max_model_len")
        w.max_model_len = n if isinstance(n, int) else None
        prior = info.get("cost_prior")
        w.cost_prior = prior if isinstance(prior, dict) else None
    new_state = ACCEPTED if reason is None else REFUSED
    if reason is not None and (w.state != REFUSED or w.refusal_reason != reason):
        log.error("refusing worker %s (%s at %s): %s", w.worker_id, w.role, w.url, reason)
    elif reason is None and w.state != ACCEPTED:
        log.info("worker %s (%s at %s) accepted", w.worker_id, w.role, w.url)
    w.state, w.refusal_reason = new_state, reason


__all__ = ["Requirements", "refusal_reason", "reported_role_swap", "needs_check", "fetch_info", "admit", "record",
           "ACCEPTED", "REFUSED", "UNCHECKED"]
