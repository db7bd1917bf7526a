"""A worker registers itself with its router (``cpd worker --router URL``).

A background thread POSTs ``{"worker_id", "role", "url", "events_endpoint"}`` to
``ROUTER/cpd/register`` (signed with the internal secret when one is set, :mod:`cpd.auth`),
again every ``interval_s`` while registered, and every ``retry_s`` while the router is
unreachable or refuses it. Re-registering is free on the router side when nothing changed, and
it is how a restarted router (which forgot registered workers) finds this worker again. A
refusal (409: another KV namespace or a smaller context; 401/403: wrong secret) is logged with
the router's reason, once per distinct answer.
"""
from __future__ import annotations

import logging
import threading

import httpx

log = logging.getLogger("cpd.worker.registration")


class Registrar:
    """Keeps one worker registered at one router until :meth:`close`."""

    def __init__(self, router_url: str, registration: dict, secret: bytes | None = None,
                 interval_s: float = 5.0, retry_s: float = 1.0, timeout_s: float = 5.0):
        from cpd.auth import client_auth
        self.url = router_url.rstrip("/") + "/cpd/register"
        self.registration = registration
        self.interval_s = interval_s
        self.retry_s = retry_s
        self.last_status: int | None = None  # HTTP status of the last answer (None: unreachable)
        self.num_registrations = 0
        self._client = httpx.Client(timeout=timeout_s, auth=client_auth(secret))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="register", daemon=True)

    def start(self) -> "Registrar":
        self._thread.start()
        return self

    def register_once(self) -> int | None:
        """One attempt; returns the HTTP status (None if the router could not be reached)."""
        try:
            r = self._client.post(self.url, json=self.registration)
        except httpx.HTTPError as e:
            self._note(None, f"router unreachable: {e!r}")
            return None
        self._note(r.status_code, r.text[:500])
        if r.status_code == 200:
            self.num_registrations += 1
        return r.status_code

    def set_role(self, role: str) -> None:
        """The worker's role changed (``POST /role``): register it now and from then on."""
        self.registration = {**self.registration, "role": str(role)}
        threading.Thread(target=self.register_once, name="register-role", daemon=True).start()

    def _note(self, status: int | None, detail: str) -> None:
        if status != self.last_status:
            level = logging.INFO if status == 200 else logging.ERROR
            log.log(level, "registration of %s at %s: %s %s", self.registration.get("worker_id"), self.url,
                    status, detail)
        self.last_status = status

    def _run(self) -> None:
        while not self._stop.is_set():
            ok = self.register_once() == 200
            self._stop.wait(self.interval_s if ok else self.retry_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._client.close()


__all__ = ["Registrar"]
