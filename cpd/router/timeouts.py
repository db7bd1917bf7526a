"""Time bounds of every router→worker call (issue 7 §3)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields

import httpx


WORKER_LINE_INTERVAL_S = 0.5
"""How often a worker sends a line on a streamed prefill or decode at the least (its progress lines and
heartbeats: ``PREFILL_PROGRESS_S`` / ``DECODE_HEARTBEAT_S`` of :mod:`cpd.worker.server`); an idle bound must exceed it."""


@dataclass(frozen=True)
class DispatchTimeouts:
    """Time bounds of every router→worker call (issue 7 §3); all in seconds.

    * Any call: TCP connect and connection-pool wait ≤ ``connect_s``.
    * ``POST /prefill`` (streamed with progress lines, :mod:`cpd.router.prefill_relay`): bounded
      by its progress, never by a guess of its length (:meth:`prefill_deadline`): a line (the
      worker sends one every 0.5 s) within ``prefill_idle_s`` of the last one, else the worker
      is stopped, dead or cut off; the worker's engine step count advancing within
      ``prefill_stall_s``, else its engine is stuck (one step, at most the engine's token
      budget, must fit in it); and the whole answer within ``prefill_cap_s``, the last resort
      against a hang. Then the worker is excluded and the request retried elsewhere.

      Why not a bound from the estimated TTFT (``prefill_floor_s + prefill_slack × estimate``,
      as before): the estimate is a model, and models are wrong exactly where it hurts (an
      8000-token prompt on SmolLM2 / 2 CPU cores ran 107 s while the router, its one-rate
      estimate skewed by batched short prefills and blind to attention's quadratic term,
      allowed less, and a valid request failed with 503). An estimate may steer routing; it
      must not fail a prefill that is making progress. Serving stacks' users expect the same:
      vLLM and SGLang do not cut a running prefill short by a length model, and disaggregated
      routers detect a failed worker by its connection or its liveness, not by the clock.
    * Decode-local append (``POST /append``): its first token is still due within
      :meth:`prefill_s` = ``min(prefill_cap_s, prefill_floor_s + prefill_slack × estimate)``
      (an append is short by construction, and one that misses is rerouted, not failed; its
      worker is not blamed while its heartbeats still come: the estimate was short, not the worker).
    * ``POST /decode``: response headers (the worker fetched the KV; it sends heartbeats while the
      KV waits for its engine's current step to end, then the tokens) within
      :meth:`decode_first_byte_s` = ``min(decode_cap_s, decode_floor_s + decode_slack × kv_bytes /
      handoff_bytes_per_s)``; then at most ``decode_idle_s`` between NDJSON lines (decode workers
      send a heartbeat line every 0.5 s while a request waits in their queue, so this bound is
      independent of queueing), and the worker's engine step count (carried by the heartbeats)
      advancing within ``decode_stall_s`` (:meth:`decode_deadline`): heartbeats prove only that
      the worker's event loop lives, and a stuck engine thread (a step that never returns) under
      a live loop would otherwise hold the stream forever. The same holds for an append.
      The decode worker's fetch of the staged KV is bounded by :meth:`handoff_fetch_s` (half the
      first-byte bound, sent as ``DecodeRequest.fetch_timeout_s``): a sender that cannot deliver
      (stopped, partitioned from the decode worker) is answered 502 ``handoff_unavailable`` in
      time, so the router re-prefills without that sender and keeps the healthy decode worker,
      instead of timing out on it and excluding it.
    * Any stream (prefill progress lines, decode heartbeats): a line whose ``engine_stuck`` is set
      (the worker's own verdict, its current step ran past its ``engine.max_step_s``) fails the
      call at once, as does a 503 ``engine_stuck`` refusal: the worker is excluded and the request
      retried elsewhere (before its first decoded token) or failed with a clear error (after).
      With the defaults a stuck decode worker ends its streams within ``engine.max_step_s`` (120 s)
      plus a heartbeat (0.5 s); ``decode_stall_s`` is the router's own bound, for a worker that
      does not judge itself.
    * ``POST /handoff/release``: ``release_s`` per try; a try that fails in transport is retried
      with backoff for at most ``release_retry_s`` (:mod:`cpd.router.staging_release`).
    * Decode slot: a request waits at most until its staging's reclaim time minus
      :meth:`staging_margin` (``min(staging_margin_s, lifetime / 4)``).

    A stopped or dead prefill worker is detected within ``prefill_idle_s`` (plus
    ``connect_s`` for the response headers), whatever the prompt's length.

    Worst case for one request: ``max_prefill_attempts`` prefill bounds, then per decode attempt
    the first-byte bound (plus one re-prefill when the staging was lost), and per mid-stream
    migration (``max_decode_migrations``, default 0) one more re-prefill and decode. Overrides: the
    ``CPD_DISPATCH_TIMEOUTS`` environment variable of the router, a JSON object of these fields.
    """

    connect_s: float = 3.0
    prefill_floor_s: float = 30.0
    prefill_slack: float = 4.0
    prefill_cap_s: float = 1800.0
    prefill_idle_s: float = 10.0
    prefill_stall_s: float = 120.0
    decode_floor_s: float = 15.0
    decode_slack: float = 4.0
    decode_cap_s: float = 120.0
    handoff_bytes_per_s: float = 1e9
    decode_idle_s: float = 10.0
    # One engine step must fit, and a decode worker's step may carry an append's prefill chunk of
    # the whole token budget (as a prefill worker's: the same 120 s as prefill_stall_s). Within it
    # a queued request's wait is free: the worker's steps advance while it serves the others.
    decode_stall_s: float = 120.0
    release_s: float = 5.0
    release_retry_s: float = 120.0  # the senders' default reclaim_after_s: past it the staging is freed anyway
    staging_margin_s: float = 5.0
    max_prefill_attempts: int = 2
    max_decode_attempts: int = 3
    # a decode whose worker fails after its first decoded token is resumed elsewhere at most this many
    # times (the prompt and the tokens so far re-prefilled); 0: the stream ends with an error
    max_decode_migrations: int = 0

    def __post_init__(self) -> None:
        """Refuse bounds no request can meet: with ``max_prefill_attempts=0`` every request failed with
        503 "prefill failed on : None", and an idle bound at or below the workers' line interval
        (:data:`WORKER_LINE_INTERVAL_S`) or a zero/negative bound marked healthy workers unhealthy on
        the first request, after which every request got 503 "no healthy prefill worker"."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") or f.name == "handoff_bytes_per_s":
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise ValueError(f"timeouts.{f.name} must be a finite number > 0, got {v!r}")
        for name in ("prefill_idle_s", "decode_idle_s"):
            if getattr(self, name) <= WORKER_LINE_INTERVAL_S:
                raise ValueError(f"timeouts.{name} must exceed the workers' line interval of "
                                 f"{WORKER_LINE_INTERVAL_S:g} s (progress lines and heartbeats), got {getattr(self, name)!r}")
        for name in ("prefill_slack", "decode_slack"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"timeouts.{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        for name, least in (("max_prefill_attempts", 1), ("max_decode_attempts", 1), ("max_decode_migrations", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"timeouts.{name} must be at least {least}, got {getattr(self, name)!r}")

    def prefill_s(self, estimate_s: float) -> float:
        return min(self.prefill_cap_s, self.prefill_floor_s + self.prefill_slack * max(0.0, estimate_s))

    def prefill_deadline(self, sent_s: float, last_line_s: float, last_step_s: float) -> tuple[float, str]:
        """When a streamed prefill sent at ``sent_s``, whose last line came at ``last_line_s``
        and whose worker last advanced its engine step count at ``last_step_s`` (one clock),
        stops being waited for, and why (the bound that ends first)."""
        return min((last_line_s + self.prefill_idle_s,
                    f"no line from the worker for {self.prefill_idle_s:g} s (stopped, dead or unreachable)"),
                   (last_step_s + self.prefill_stall_s,
                    f"the worker's engine made no step for {self.prefill_stall_s:g} s (stuck)"),
                   (sent_s + self.prefill_cap_s, f"the prefill ran past the cap of {self.prefill_cap_s:g} s"))

    def decode_deadline(self, last_line_s: float, last_step_s: float) -> tuple[float, str]:
        """When a decode or append stream whose last line came at ``last_line_s`` and whose worker
        last advanced its engine step count (or sent tokens) at ``last_step_s`` stops being
        waited for, and why."""
        return min((last_line_s + self.decode_idle_s,
                    f"no line from the worker for {self.decode_idle_s:g} s (stopped, dead or unreachable)"),
                   (last_step_s + self.decode_stall_s,
                    f"the worker's engine made no step for {self.decode_stall_s:g} s (stuck)"))

    def decode_first_byte_s(self, kv_bytes: int) -> float:
        return min(self.decode_cap_s, self.decode_floor_s + self.decode_slack * max(0, kv_bytes) / self.handoff_bytes_per_s)

    def handoff_fetch_s(self, kv_bytes: int) -> float:
        """The decode worker's bound on fetching ``kv_bytes`` of staged KV: half of
        :meth:`decode_first_byte_s`, so its 502 arrives (and the KV is admitted) within it."""
        return self.decode_first_byte_s(kv_bytes) / 2

    def staging_margin(self, lifetime_s: float) -> float:
        return min(self.staging_margin_s, lifetime_s / 4)

    def httpx(self, read_s: float) -> httpx.Timeout:
        return httpx.Timeout(read_s, connect=self.connect_s, pool=self.connect_s)

    @classmethod
    def from_env(cls, environ=os.environ) -> "DispatchTimeouts":
        raw = environ.get("CPD_DISPATCH_TIMEOUTS")
        if not raw:
            return cls()
        known = {f.name: f.type for f in fields(cls)}
        given = json.loads(raw)
        unknown = set(given) - set(known)
        if unknown:
            raise ValueError(f"CPD_DISPATCH_TIMEOUTS: unknown fields {sorted(unknown)}")
        return cls(**given)
