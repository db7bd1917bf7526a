"""Open-loop async replay of bench requests against an OpenAI-compatible server.

A request whose ``after`` names other requests (closed-loop session replay) is sent ``gap_s``
after all of them have finished; its recorded ``arrival_s`` is that moment.

Each request is ``POST {url}/v1/completions`` with a token-id prompt::

    {"model": M, "prompt": [ids], "max_tokens": output_length, "ignore_eos": true,
     "stream": true, "stream_options": {"include_usage": true}, "temperature": 0}

and the server-sent-event stream (``data: {...}`` lines ending with ``data: [DONE]``) is timed per
chunk. Requests are sent at their scheduled arrival time whether or not earlier ones finished
(open loop); ``max_concurrency`` optionally caps in-flight requests, in which case a request that
has to wait is sent later and ``sched_lag_s`` records by how much.

All times are seconds. ``arrival_s`` / ``send_s`` are offsets from the replay start; TTFT, TPOT,
ITL and e2e latency are measured from ``send_s`` (the moment the HTTP request is issued).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import httpx

from .trace import BenchRequest


def base_url(url: str) -> str:
    """Normalise a server URL: strip trailing ``/`` and a trailing ``/v1``."""
    u = url.rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def fetch_models(url: str, *, timeout_s: float = 30.0, api_key: str | None = None,
                 trust_env: bool = False) -> list[dict[str, Any]]:
    """``GET {url}/v1/models`` and return its ``data`` list (model cards).

    Raises ``httpx.HTTPError`` on connection errors or a non-2xx status, ``ValueError`` if the body
    has no ``data`` list.
    """
    r = httpx.get(f"{base_url(url)}/v1/models", timeout=timeout_s, headers=_headers(api_key),
                  trust_env=trust_env)
    r.raise_for_status()
    body = r.json()
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError(f"{url}/v1/models: no 'data' list in response")
    return data


def pick_model(cards: Sequence[dict[str, Any]], model: str | None = None) -> dict[str, Any]:
    """The card whose ``id`` is ``model`` (or the first card when ``model`` is None).

    Raises ``ValueError`` if there is no card, or ``model`` is not served (a card ``{"id": model}``
    is returned instead when ``cards`` is empty but ``model`` is given).
    """
    if model is None:
        if not cards:
            raise ValueError("server lists no models; pass --model")
        return cards[0]
    for c in cards:
        if c.get("id") == model:
            return c
    if not cards:
        return {"id": model}
    raise ValueError(f"model {model!r} not served; available: {[c.get('id') for c in cards]}")


@dataclass
class RequestRecord:
    """Measurements of one replayed request (seconds; token counts).

    ``ttft_s``: send → first chunk carrying non-empty text or token ids. ``tpot_s``:
    ``(t_last - t_first) / (output_tokens - 1)`` (None if fewer than 2 tokens). ``itls_s``: gaps
    between successive token-carrying chunks. ``output_tokens``: ``usage.completion_tokens`` when
    the server sends usage, else the number of streamed tokens. ``prompt_tokens`` /
    ``cached_tokens``: from ``usage`` (``usage.prompt_tokens_details.cached_tokens``), None if not
    reported. ``error``: None on success, else ``"HTTP <status>: <message>"``, ``"timeout ..."`` or
    ``"<ExceptionType>: <message>"``; ``status`` is the HTTP status (0 when there was none).
    """

    id: str
    line: int
    trace_class: str
    reuse: float
    arrival_s: float
    prompt_len: int
    max_tokens: int
    kind: str = ""
    session: str = ""
    uncached_trace_tokens: int = 0
    send_s: float | None = None
    sched_lag_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    streamed_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class ReplayResult:
    """Outcome of a replay: served ``model``, ``records`` (in request order), wall-clock
    ``started_at`` (Unix seconds) and ``duration_s`` (replay start → last request finished)."""

    model: str
    records: list[RequestRecord]
    started_at: float
    duration_s: float


def request_body(req: BenchRequest, model: str, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for ``req``."""
    body: dict[str, Any] = {
        "model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
    }
    if extra_body:
        body.update(extra_body)
    return body


def _error_message(status: int, raw: bytes) -> str:
    msg = raw.decode("utf-8", "replace").strip()
    try:
        d = json.loads(msg)
        err = d.get("error", d.get("detail", d)) if isinstance(d, dict) else d
        if isinstance(err, dict):
            err = err.get("message", err)
        msg = str(err)
    except ValueError:
        pass
    return f"HTTP {status}: {msg[:500]}"


def _chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens carried by one stream chunk (0 for usage-only / empty chunks)."""
    n = 0
    for ch in chunk.get("choices") or ():
        ids = ch.get("token_ids")
        text = ch.get("text")
        if text is None and isinstance(ch.get("delta"), dict):
            text = ch["delta"].get("content")
        if isinstance(ids, list) and ids:
            n += len(ids)
        elif text:
            n += 1
    return n


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord,
                      t_send: float, token_times: list[float], headers: dict[str, str]) -> None:
    """Send one request and fill ``rec`` as chunks arrive (so a timeout keeps partial data)."""
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        rec.status = resp.status_code
        if resp.status_code != 200:
            rec.error = _error_message(resp.status_code, await resp.aread())
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            if not payload:
                continue
            now = time.perf_counter()
            try:
                chunk = json.loads(payload)
            except ValueError:
                rec.error = f"bad SSE payload: {payload[:200]}"
                return
            if "error" in chunk and not chunk.get("choices"):
                err = chunk["error"]
                rec.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)
                return
            n = _chunk_tokens(chunk)
            if n:
                if not token_times:
                    rec.ttft_s = now - t_send
                token_times.append(now)
                rec.streamed_tokens += n
            for ch in chunk.get("choices") or ():
                if ch.get("finish_reason"):
                    rec.finish_reason = ch["finish_reason"]
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                if usage.get("completion_tokens") is not None:
                    rec.output_tokens = int(usage["completion_tokens"])
                if usage.get("prompt_tokens") is not None:
                    rec.prompt_tokens = int(usage["prompt_tokens"])
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and details.get("cached_tokens") is not None:
                    rec.cached_tokens = int(details["cached_tokens"])


def _finish(rec: RequestRecord, token_times: list[float], t_send: float, t_end: float) -> None:
    rec.e2e_s = t_end - t_send
    if rec.output_tokens == 0:
        rec.output_tokens = rec.streamed_tokens
    rec.itls_s = [b - a for a, b in zip(token_times, token_times[1:])]
    if len(token_times) >= 1 and rec.output_tokens > 1:
        rec.tpot_s = (token_times[-1] - token_times[0]) / (rec.output_tokens - 1)


def _raise_fd_limit(want: int) -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


async def replay(url: str, requests: Sequence[BenchRequest], *, model: str | None = None,
                 max_concurrency: int | None = None, timeout_s: float = 600.0,
                 max_connections: int = 2048, api_key: str | None = None,
                 extra_body: dict[str, Any] | None = None, trust_env: bool = False,
                 on_done: Callable[[RequestRecord], None] | None = None,
                 client: httpx.AsyncClient | None = None) -> ReplayResult:
    """Replay ``requests`` open-loop against ``url`` and measure each one.

    ``model``: model name (default: first id of ``GET {url}/v1/models``). ``max_concurrency``:
    cap on in-flight requests (None: unlimited, pure open loop). ``timeout_s``: total budget per
    request (connect → last byte); a request over it is cancelled and recorded as an error.
    ``max_connections``: HTTP connection pool size when there is no concurrency cap.
    ``on_done`` is called with each finished record. Never raises for per-request failures; they
    are recorded in ``RequestRecord.error``. Raises ``httpx.HTTPError`` / ``ValueError`` if the
    model cannot be determined.
    """
    base = base_url(url)
    headers = _headers(api_key)
    pool = max_concurrency or max_connections
    _raise_fd_limit(pool + 256)
    own = client is None
    if client is None:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, pool=None),
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
            trust_env=trust_env)
    try:
        # Always one request before the clock starts: it also pays the HTTP stack's one-time
        # costs (lazy imports, first connection) that would otherwise delay the first arrivals.
        try:
            r = await client.get(f"{base}/v1/models", headers=headers)
        except httpx.HTTPError:
            if model is None:
                raise
            r = None
        if model is None:
            assert r is not None  # without a model, a failed /v1/models call raised above
            r.raise_for_status()
            model = pick_model(r.json().get("data") or [])["id"]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        records = [RequestRecord(id=q.id, line=q.line, trace_class=q.trace_class, reuse=q.reuse,
                                 arrival_s=q.arrival_s, prompt_len=q.prompt_len, max_tokens=q.max_tokens,
                                 kind=getattr(q, "kind", ""), session=getattr(q, "session", ""),
                                 uncached_trace_tokens=getattr(q, "uncached_trace_tokens", 0))
                   for q in requests]
        finished = [asyncio.Event() for _ in requests]
        endpoint = f"{base}/v1/completions"
        t0 = time.perf_counter() + 0.01
        started_at = time.time() + 0.01
        last_end = [t0]

        async def one(i: int) -> None:
            try:
                await send(i)
            finally:
                finished[i].set()

        async def send(i: int) -> None:
            req, rec = requests[i], records[i]
            after = getattr(req, "after", ())
            if after:  # closed loop: gap_s after every request this one waits for has finished
                for d in after:
                    await finished[d].wait()
                rec.arrival_s = time.perf_counter() - t0 + req.gap_s
                await asyncio.sleep(req.gap_s)
            body = request_body(req, model, extra_body)  # build the prompt before taking a slot
            if sem is not None:
                await sem.acquire()
            token_times: list[float] = []
            t_send = time.perf_counter()
            rec.send_s = t_send - t0
            rec.sched_lag_s = rec.send_s - rec.arrival_s
            try:
                await asyncio.wait_for(_stream_one(client, endpoint, body, rec, t_send, token_times, headers),
                                       timeout_s)
            except asyncio.TimeoutError:
                rec.error = f"timeout after {timeout_s:g}s"
            except httpx.TimeoutException as e:
                rec.error = f"timeout: {type(e).__name__}: {e}"
            except httpx.HTTPError as e:
                rec.error = f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - a bench never dies of one bad request
                rec.error = f"{type(e).__name__}: {e}"
            finally:
                if sem is not None:
                    sem.release()
            t_end = time.perf_counter()
            _finish(rec, token_times, t_send, t_end)
            last_end[0] = max(last_end[0], t_end)
            if on_done is not None:
                on_done(rec)

        tasks = []
        for i in order:
            if getattr(requests[i], "after", ()):
                tasks.append(asyncio.create_task(one(i)))  # waits for its predecessors itself
                continue
            delay = t0 + requests[i].arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        if tasks:
            await asyncio.gather(*tasks)
        return ReplayResult(model=model, records=records, started_at=started_at,
                            duration_s=max(0.0, last_end[0] - t0))
    finally:
        if own:
            await client.aclose()


def run_replay(url: str, requests: Sequence[BenchRequest], **kwargs: Any) -> ReplayResult:
    """Synchronous wrapper: ``asyncio.run(replay(url, requests, **kwargs))``."""
    return asyncio.run(replay(url, requests, **kwargs))


__all__ = ["base_url", "fetch_models", "pick_model", "RequestRecord", "ReplayResult", "request_body",
           "replay", "run_replay"]
