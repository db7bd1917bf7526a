"""How long after a block is computed does the router learn its L3 copy? (issue 10/11, live side)

A live modeled deployment (``benchmarks/modeled_ordering.py``'s ``live_config``, one configuration
with write-through, default ``pd-l3``) serves ``modeled_ordering``'s workload at one point; this
process subscribes to every prefill-side worker's KV-event publisher (the router's own subscription, the same
ZMQ PUB sockets) and timestamps each batch on arrival. Per block hash: ``t_L1`` = the first
``BlockStored(medium=GPU)`` (the step that computed it: the engine emits it during the step and the
worker flushes its events right after the step), ``t_L3`` = the first ``BlockStored(medium=L3)``
(the store's announcement after the write-through). The L3-visibility lag beyond the computing
step's end is ``t_L3 - t_L1`` (wall s; / K = modeled s). The simulator publishes both at the
step's end plus ``kv_event_delay`` (lag 0). Also reported: the intervals between a worker's
consecutive event batches (≈ its step times while busy), in modeled s.

Usage::

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/l3_visibility_lag.py --point 4.5 --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import benchmarks.modeled_ordering as mo  # noqa: E402
from cpd.kv.events import MEDIUM_L1, MEDIUM_L3, BlockStored  # noqa: E402
from cpd.sim.engine_sim import request_tokens  # noqa: E402
from cpd.sim.stats import pct, rnd  # noqa: E402


class EventClock:
    """Arrival times of every worker's KV-event batches (a subscriber of its own)."""

    def __init__(self) -> None:
        self.first: dict[tuple[str, int], tuple[float, str]] = {}  # (medium, hash) -> (t, worker)
        self.batches: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def on_batch(self, wid: str, seq: int, batch: Any) -> None:
        t = time.monotonic()
        with self._lock:
            self.batches.setdefault(wid, []).append(t)
            for ev in batch.events:
                if isinstance(ev, BlockStored) and ev.medium in (MEDIUM_L1, MEDIUM_L3, None):
                    medium = ev.medium or MEDIUM_L1
                    for h in ev.block_hashes:
                        self.first.setdefault((medium, int(h)), (t, wid))


def lags(clock: EventClock, k: float) -> dict[str, Any]:
    out: list[float] = []
    same_worker = 0
    for (medium, h), (t3, w3) in clock.first.items():
        if medium != MEDIUM_L3:
            continue
        l1 = clock.first.get((MEDIUM_L1, h))
        if l1 is None:
            continue
        out.append((t3 - l1[0]) / k)
        same_worker += l1[1] == w3
    gaps = [(b - a) / k for ts in clock.batches.values() for a, b in zip(ts, ts[1:])]
    q = (0.1, 0.5, 0.9, 0.99)
    return {"blocks": len(out), "l3_from_computing_worker": same_worker,
            "lag_modeled_s": {f"p{int(x * 100)}": rnd(pct(out, x), 4) for x in q} | {
                "mean": rnd(sum(out) / len(out), 4) if out else None, "max": rnd(max(out), 4) if out else None},
            "share_lag_under_5ms_modeled": rnd(sum(x < 0.005 for x in out) / max(1, len(out)), 4),
            "batch_interval_modeled_s": {f"p{int(x * 100)}": rnd(pct(gaps, x), 4) for x in q}}


def sim_lags(a: argparse.Namespace, config: str, reqs: list, vocab: int, model_dir: str, l3_events: str) -> dict:
    """The same quantity in the simulator (``modeled_ordering.run_sim`` with ``--l3-events``
    ``l3_events``): the index's event applications, timed on the virtual clock (modeled s; the
    simulator adds ``kv_event_delay`` to both media alike)."""
    clock = EventClock()

    class Spy(mo.EngineSimulator):
        def _apply_events(self, now, wid, seq, batch):  # type: ignore[no-untyped-def]
            if wid.startswith("decode"):
                return super()._apply_events(now, wid, seq, batch)
            for ev in batch.events:
                if isinstance(ev, BlockStored) and ev.medium in (MEDIUM_L1, MEDIUM_L3):
                    for h in ev.block_hashes:
                        clock.first.setdefault((ev.medium, int(h)), (now, wid))
            clock.batches.setdefault(wid, []).append(now)
            super()._apply_events(now, wid, seq, batch)

    orig, mo.EngineSimulator = mo.EngineSimulator, Spy
    try:
        a2 = argparse.Namespace(**{**vars(a), "l3_events": l3_events})
        rows = mo.run_sim(a2, config, reqs, vocab, model_dir)
    finally:
        mo.EngineSimulator = orig
    return {**lags(clock, 1.0), "goodput": mo.summarise(rows, a2, a.warm if a.warm is not None else a.duration / 4)[
        "goodput"]}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--point", type=float, default=4.5, help="total QPS (modeled)")
    p.add_argument("--config", default="pd-l3")
    p.add_argument("--sim-only", action="store_true", help="only the simulator's figures (both --l3-events)")
    own, rest = p.parse_known_args(argv)
    a = mo.parse_args(rest)
    from cpd.deploy import Deployment
    from cpd.engine.weights import make_tiny_llama_dir
    from cpd.kv.event_bus import EventSubscriber
    model_dir = str(make_tiny_llama_dir(Path(tempfile.mkdtemp(prefix="cpd-l3lag-")) / "tiny-llama", seed=0))
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    reqs = mo.workload(a, own.point)
    cache: dict = {}
    prompts = [request_tokens(r, a.block_size, cache, vocab) for r in reqs]
    sims = {ev: sim_lags(a, own.config, reqs, vocab, model_dir, ev) for ev in ("step-end", "next-flush")}
    if own.sim_only:
        print(json.dumps(sims, indent=1))
        return sims
    clock = EventClock()
    load0 = mo._load()
    with Deployment(mo.live_config(a, own.config, model_dir)) as dep:
        sub = EventSubscriber(clock.on_batch)
        for w in dep.workers:
            if w.get("role") != "decode":  # the prefill side: the workers that compute and write
                sub.add(w["worker_id"], w["events_endpoint"])
        time.sleep(1.0)  # the subscriptions connect
        sent = asyncio.run(mo._send_all(dep.url, dep.model_name, prompts, reqs, a.time_dilation, timeout_s=600.0))
        time.sleep(1.0)
        sub.close()
    res = {"args": vars(a), "point": own.point, "config": own.config, "requests": len(reqs),
           "failed": sum(1 for s in sent if s.get("error")), "load_1m_start": rnd(load0, 2),
           "load_1m_end": rnd(mo._load(), 2), "live": lags(clock, a.time_dilation), "sim": sims}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
