"""Workers announce themselves to the router: ``POST /cpd/register`` (issue 12 §1).

Body: ``{"worker_id", "role", "url", "events_endpoint"}`` — where the router reaches the
worker's internal API and KV-event publisher. With an internal secret configured the request
must be signed (:mod:`cpd.auth`; 401 unsigned, 403 wrong secret, both logged); with client API keys
on and no internal secret it is refused (403 ``internal_secret_required``, as ``POST /cpd/role``):
the route bypasses the API-key check, so it would be open to anyone. The router then
checks the worker as it checks a statically configured one (``GET /info``:
:mod:`cpd.router.compat`): a worker with another KV namespace or a smaller context is refused
(409 with the reason; logged), never routed to.

Registration is idempotent and cheap when nothing changed (a dictionary lookup): workers
re-register periodically (:mod:`cpd.worker.registration`), which is how a restarted router
relearns its workers, and a storm of registrations costs the serving path nothing but the
request parsing; beyond ``max_per_s`` registrations per second (all workers together; a
worker re-registers every few seconds) the router answers 429 before checking the signature, so a
storm costs bounded CPU. A known ``worker_id`` at a new address (the worker moved or restarted
elsewhere) replaces the old address once the new one passes the same check (until then the
known worker is left as it was), and not while the old address still answers as that worker id
with another boot id (two live processes with one id: 409 ``duplicate_worker_id``); so does a
known worker registering with another kind of role (decode <-> prefill side). A registration
whose address answers as another worker id is refused. A moved worker's index entries are
dropped and rebuilt. At most
``max_workers`` distinct workers are kept (429 beyond).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cpd.router import compat
from cpd.router.workers import WorkerInfo

if TYPE_CHECKING:
    from cpd.router.app import Router

log = logging.getLogger("cpd.router.registration")
DEFAULT_MAX_WORKERS = 1024
DEFAULT_MAX_PER_S = 50.0  # registrations accepted per second, all workers together (burst: 2 s worth)


class TokenBucket:
    """``rate_per_s`` tokens per second, at most ``burst`` saved; :meth:`take` spends one."""

    def __init__(self, rate_per_s: float, burst: float):
        self.rate_per_s, self.burst = rate_per_s, burst
        self.tokens, self.t = burst, time.monotonic()
        self.num_refused = 0

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate_per_s)
        self.t = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.num_refused += 1
        return False


class Registration(BaseModel):
    """What a worker sends (its ``/info`` is fetched separately for the compatibility check)."""

    model_config = ConfigDict(extra="ignore")
    worker_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    role: Literal["pre-prefill", "prefill", "decode"]
    url: str = Field(pattern=r"^https?://[^\s/]+$")
    events_endpoint: str = Field(pattern=r"^tcp://[^\s/]+$")


def _error(status: int, message: str, code: str) -> JSONResponse:
    typ = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": typ, "param": None, "code": code}},
                        status_code=status)


async def register(router: "Router", reg: Registration, max_workers: int = DEFAULT_MAX_WORKERS) -> JSONResponse:
    """Add or update one worker, then check it; the answer says whether it is routed to."""
    known = router.workers.by_id.get(reg.worker_id)
    if known is not None and (known.url, known.events_endpoint, known.role) == (reg.url, reg.events_endpoint,
                                                                                  reg.role):
        if known.state == compat.ACCEPTED:
            return JSONResponse({"worker_id": reg.worker_id, "state": known.state, "known": True})
    elif known is None and len(router.workers.by_id) >= max_workers:
        return _error(429, f"the router holds {max_workers} workers already", "too_many_workers")
    refused = await _check_candidate(router, reg, known)
    if refused is not None:  # a known worker stays where it is, routed to as before
        return refused
    w = _upsert(router, reg, known)
    ok = await router._admit(w)
    if not ok:
        return _error(409, f"worker {reg.worker_id} refused: {w.refusal_reason or 'unreachable for GET /info'}",
                      "worker_refused")
    return JSONResponse({"worker_id": reg.worker_id, "state": w.state, "known": known is not None})


def _changes_identity(known: WorkerInfo, reg: Registration) -> bool:
    """A registration that would move ``known`` to another address or give it another kind of
    role (decode <-> prefill side; a prefill-side swap is an elastic role change)."""
    sides = {"pre-prefill", "prefill"}
    return (known.url, known.events_endpoint) != (reg.url, reg.events_endpoint) or \
        (known.role != reg.role and not {known.role, reg.role} <= sides)


async def _check_candidate(router: "Router", reg: Registration, known: WorkerInfo | None) -> JSONResponse | None:
    """Check a registration before it changes anything: the worker answering at its address must
    be the one it names (a registration naming another worker's address would make one process
    two workers, or take the named one out); a known worker is moved to another address or role
    only once that address passes the compatibility check, and not while the known address still
    answers as that worker id with another boot id (two live processes with one id: each
    re-registration moved it back and forth, and its index with it). None: go on; else the 409."""
    probe = WorkerInfo(reg.worker_id, reg.role, reg.url, reg.events_endpoint)
    info: dict | None = None
    reason: str | None = None
    code = "worker_refused"
    try:
        info = await compat.fetch_info(router._http(), probe)
    except (httpx.HTTPError, ValueError) as e:
        if known is None:  # a new worker: admitted once it answers (router._admit, the poller)
            return None
        reason = f"unreachable for GET /info ({type(e).__name__})"
    if info is not None:
        incompatible = compat.refusal_reason(info, reg.role, router.requirements)
        if known is None and incompatible is not None:
            return None  # recorded as a refused worker by router._admit, as any incompatible one
        reason = incompatible if known is not None and _changes_identity(known, reg) else None
        if reason is None and info.get("worker_id") != reg.worker_id:
            reason = f"the worker answering there is {info.get('worker_id')!r}"
        if reason is None and known is not None and _changes_identity(known, reg):
            reason = await _live_twin(router, known, reg, info)
            code = "duplicate_worker_id"
    if reason is None:
        return None
    log.warning("worker %s: registration at %s (%s) refused%s: %s", reg.worker_id, reg.url, reg.role,
                f", kept at {known.url} ({known.role})" if known is not None else "", reason)
    return _error(409, f"worker {reg.worker_id} refused at {reg.url}: {reason}", code)


async def _live_twin(router: "Router", known: WorkerInfo, reg: Registration, info: dict) -> str | None:
    """Why ``known`` may not move: its address still answers as the same worker id with another
    boot id than the registering process's ``info``. None when that address does not answer, is
    another worker now, or is the same process (one boot id reached at another address)."""
    if known.url == reg.url:  # same address: the registering process answered there
        return None
    try:
        there = await compat.fetch_info(router._http(), known)
    except (httpx.HTTPError, ValueError):
        return None
    if there.get("worker_id") != known.worker_id or there.get("boot_id") == info.get("boot_id"):
        return None
    return (f"worker id {known.worker_id!r} is in use by a live worker at {known.url} "
            f"(boot id {there.get('boot_id')}); give this worker another --worker-id or stop that one")


def _upsert(router: "Router", reg: Registration, known: WorkerInfo | None) -> WorkerInfo:
    """Create the worker, or move a known one to the registered address (its index entries are
    dropped and rebuilt from its snapshot); an unchanged one is returned as is."""
    if known is None:
        w = WorkerInfo(reg.worker_id, reg.role, reg.url, reg.events_endpoint)
        router.workers.by_id[w.worker_id] = w
        if router.backend is not None:  # the app is built (always, once requests arrive)
            router.backend.decode_slots.setdefault(w.worker_id, asyncio.Semaphore(router.max_decode_per_worker))
        log.warning("worker %s (%s) registered at %s", w.worker_id, w.role, w.url)
        new_events = True
    elif (known.url, known.events_endpoint) == (reg.url, reg.events_endpoint) and \
            {known.role, reg.role} <= {"pre-prefill", "prefill"}:  # only its prefill-side role changed (POST /role)
        router.workers.set_role(known.worker_id, reg.role, "re-registered with a new role (elastic roles)")
        return known
    elif (known.url, known.events_endpoint, known.role) != (reg.url, reg.events_endpoint, reg.role):
        w = known
        log.warning("worker %s moved: %s %s -> %s %s", w.worker_id, w.role, w.url, reg.role, reg.url)
        router.index.drop_worker(w.worker_id)
        new_events = w.events_endpoint != reg.events_endpoint
        w.url, w.role, w.events_endpoint, w.boot_id = reg.url, reg.role, reg.events_endpoint, None
    else:
        return known
    if new_events and router.subscriber is not None:
        router.subscriber.add(w.worker_id, w.events_endpoint)
    router._resync_pending.add(w.worker_id)
    return w


def check_signature(request: Request, body: bytes, secret: bytes | None, max_skew_s: float | None,
                    what: str) -> JSONResponse | None:
    """None if ``request`` may go on (signed with the internal secret, or no secret is set);
    else the 401/403 answer (logged). For the router's self-authenticated internal routes."""
    from cpd.auth import DEFAULT_MAX_SKEW_S, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify
    if not secret:
        return None
    bad = verify(secret, "POST", request.url.path, body, request.headers.get(TIMESTAMP_HEADER),
                 request.headers.get(SIGNATURE_HEADER), time.time(), max_skew_s or DEFAULT_MAX_SKEW_S)
    if bad is None:
        return None
    client = request.client.host if request.client else "?"
    log.error("refused %s from %s: %s", what, client, bad[1])
    return _error(bad[0], bad[1], "missing_signature" if bad[0] == 401 else "invalid_signature")


def install(app: FastAPI, router: "Router", secret: bytes | None, max_skew_s: float | None = None,
            max_per_s: float = DEFAULT_MAX_PER_S) -> None:
    """Add ``POST /cpd/register`` to the router's app (signed when ``secret`` is set)."""
    bucket = app.state.registration_bucket = TokenBucket(max_per_s, 2 * max_per_s)

    @app.post("/cpd/register", include_in_schema=False)
    async def register_route(request: Request):
        if not bucket.take():
            r = _error(429, "too many registrations; retry later", "registration_rate_limited")
            r.headers["Retry-After"] = "1"
            return r
        if not secret and router.api_keys.enabled:  # clients authenticate, workers would not: refuse
            log.error("refused a registration from %s: client API keys are on but no internal secret is set",
                      request.client.host if request.client else "?")
            return _error(403, "POST /cpd/register needs the internal secret (auth.internal_secret_file or "
                               "$CPD_INTERNAL_SECRET) when client API keys are on", "internal_secret_required")
        body = await request.body()
        refused = check_signature(request, body, secret, max_skew_s, "a registration")
        if refused is not None:
            return refused
        try:
            reg = Registration.model_validate_json(body)
        except ValidationError as e:
            return _error(400, f"bad registration: {e.errors()[0]['loc']} {e.errors()[0]['msg']}",
                          "invalid_registration")
        return await register(router, reg)


__all__ = ["Registration", "TokenBucket", "register", "install", "check_signature", "DEFAULT_MAX_WORKERS", "DEFAULT_MAX_PER_S"]
