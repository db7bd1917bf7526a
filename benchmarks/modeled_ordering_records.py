"""benchmarks/modeled_ordering.py, unchanged, that also keeps each live run's ``/cpd/requests`` records.

The ordering benchmark reads the router's per-request records (``/cpd/requests``) of each live run
but keeps only TTFT, class, pool and cache hits. This wrapper runs the same ``main`` with the same
arguments and writes, per live run, one JSON line per request in arrival order: the request's
arrival (modeled s), its id, and the router's whole record (wall-clock seconds, not divided by K),
which carries the prefill worker's own account — ``worker_prefill_s`` (its whole call),
``worker_queue_s`` (waiting for the engine), ``worker_compute_s`` (the rest) — so a live TTFT can
be split into router-side time (``ttft_s - worker_prefill_s``), queue and compute.

Usage (same arguments as modeled_ordering.py, plus where to write the records)::

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/modeled_ordering_records.py \\
        --records-dir DIR --points 3,4.5,6 --duration 30 --json out.json

Writes ``DIR/<n>req-<last arrival>s-<config>.jsonl`` (the benchmark's log-folder tag: one per point).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import benchmarks.modeled_ordering as mo  # noqa: E402


class _RecordingHttpx:
    """``httpx`` as the benchmark module sees it: every ``get`` of ``/cpd/requests`` is remembered."""

    def __init__(self) -> None:
        self.last_records: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(httpx, name)

    def get(self, url: str, *args: Any, **kwargs: Any) -> httpx.Response:
        resp = httpx.get(url, *args, **kwargs)
        if url.endswith("/cpd/requests"):
            self.last_records = resp.json()
        return resp


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--records-dir" not in argv:
        raise SystemExit("--records-dir DIR is required")
    i = argv.index("--records-dir")
    out_dir = Path(argv[i + 1])
    del argv[i:i + 2]
    out_dir.mkdir(parents=True, exist_ok=True)

    rec_httpx = _RecordingHttpx()
    mo.httpx = rec_httpx  # the module's global: run_live reads it at call time
    orig_send_all, orig_run_live = mo._send_all, mo.run_live
    last_sent: list[list[dict]] = []

    async def send_all(*args: Any, **kwargs: Any) -> list[dict]:
        out = await orig_send_all(*args, **kwargs)
        last_sent.append(out)
        return out

    def run_live(a, name, reqs, prompts, model_dir):  # type: ignore[no-untyped-def]
        last_sent.clear()
        rec_httpx.last_records = None
        rows, facts = orig_run_live(a, name, reqs, prompts, model_dir)
        sent = last_sent[-1] if last_sent else []
        recs = rec_httpx.last_records or {}
        path = out_dir / f"{mo.reqs_tag(reqs)}-{name}.jsonl"
        try:
            with path.open("w") as f:
                for q, s in zip(reqs, sent):
                    rid = s.get("id") or ""
                    f.write(json.dumps({"arrival_s": q.arrival_s, "id": rid, "prompt_tokens": q.prompt_tokens,
                                        "tag": q.tag, "client_error": s.get("error"),
                                        "client_finish_s": s.get("finish_s"), "tokens": s.get("tokens"),
                                        "send_lag_s": s.get("send_lag_s"), "record": recs.get(rid)}) + "\n")
        except (OSError, TypeError, ValueError) as e:  # keeping records must not lose the run
            print(f"records of {name} not written: {e!r}", file=sys.stderr, flush=True)
        return rows, facts

    mo._send_all = send_all
    mo.run_live = run_live
    return mo.main(argv)


if __name__ == "__main__":
    main()
