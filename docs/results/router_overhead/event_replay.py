"""The router's KV-event work per request, replayed offline (issue 13, router overhead: events).

``record OUT.pkl [--requests N]``: starts the deployment of ``bench_router_request.py`` (modeled
workers of the tree on ``PYTHONPATH``: 1 pre-prefill, 1 prefill, 1 decode, 40 000 L1 blocks, 1 GiB
of L2, static routing), subscribes to every worker's KV events (raw payloads and sequence numbers),
sends N fresh random 128K-token-id requests (``max_tokens = 2``, one at a time) and pickles what it
received. ``replay OUT.pkl``: counts the events by worker, kind and medium, and times (CPU, min of
3) decoding every payload and applying it to a fresh :class:`cpd.router.index.PrefixIndex`, as the
router's event thread does, once with the full decode and once with the index's decode (when the
tree has it); ms per request; all events, and the L1/L2 events alone (the L3 write-through's
per-chunk events vary in number between recordings). Without HTTP, ZMQ or the other threads: the least disturbed figure.

    PYTHONPATH=TREE .venv/bin/python docs/results/router_overhead/event_replay.py record /tmp/ev.pkl
    PYTHONPATH=TREE .venv/bin/python docs/results/router_overhead/event_replay.py replay /tmp/ev.pkl
"""
from __future__ import annotations

import argparse
import collections
import pickle
import random
import tempfile
import threading
import time
from pathlib import Path

DEPLOYMENT = {"router.port": 0, "deployment.supervise": False, "router.routing_mode": "static",
              "engine.executor": "modeled", "engine.hardware": "b200", "engine.model_shape": "llama-3.1-8b",
              "engine.tp": 4, "engine.time_dilation": 0.05, "engine.num_blocks": 40000,
              "kv.host_kv_bytes": 1 << 30, "handoff.arena_bytes": 64 << 20}


def record(out: str, num_requests: int, prompt_tokens: int) -> None:
    import httpx
    import zmq

    from cpd.config import build_config
    from cpd.deploy import Deployment
    from cpd.engine.weights import make_tiny_llama_dir
    from cpd.kv.event_bus import TOPIC

    tmp = Path(tempfile.mkdtemp(prefix="event-replay-"))
    model_dir = str(make_tiny_llama_dir(tmp / "tiny-llama", seed=0))
    received: list[tuple[str, bytes, bytes]] = []
    stop = threading.Event()
    with Deployment(build_config(overrides={"model.dir": model_dir, **DEPLOYMENT}), log_dir=str(tmp / "logs")) as dep:
        ctx = zmq.Context.instance()
        socks = {}
        for w in dep.workers:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, TOPIC)
            s.connect(w["events_endpoint"])
            socks[s] = w["worker_id"]

        def listen() -> None:
            poller = zmq.Poller()
            for s in socks:
                poller.register(s, zmq.POLLIN)
            while not stop.is_set():
                for s, _ in poller.poll(50):
                    _, seq, payload = s.recv_multipart()
                    received.append((socks[s], seq, payload))

        thread = threading.Thread(target=listen)
        thread.start()
        time.sleep(1.0)
        rng = random.Random(0)
        with httpx.Client(timeout=600) as client:
            for _ in range(num_requests):
                body = {"prompt": [rng.randrange(10, 40000) for _ in range(prompt_tokens)], "max_tokens": 2,
                        "temperature": 0, "ignore_eos": True}
                r = client.post(dep.url + "/v1/completions", json=body)
                r.raise_for_status()
        time.sleep(1.0)
        stop.set()
        thread.join()
    Path(out).write_bytes(pickle.dumps({"received": received, "num_requests": num_requests}))
    print(f"{len(received)} batches, {sum(len(p) for *_, p in received)} bytes")


def replay(path: str) -> None:
    from cpd.kv import events
    from cpd.router.index import PrefixIndex

    d = pickle.loads(Path(path).read_bytes())
    received, n = d["received"], d["num_requests"]
    count: collections.Counter = collections.Counter()
    hashes: collections.Counter = collections.Counter()
    for w, _, payload in received:
        for ev in events.decode_batch(payload).events:
            k = (w, type(ev).__name__, getattr(ev, "medium", None))
            count[k] += 1
            hashes[k] += len(getattr(ev, "block_hashes", ()))
    for k in sorted(count, key=str):
        print(f"{k}: {count[k] / n:.0f} events, {hashes[k] / n:.0f} block hashes per request")
    print(f"payload: {sum(len(p) for *_, p in received) / n / 1e6:.2f} MB per request")
    decoders = [events.decode_batch] + ([events.decode_batch_for_index] if hasattr(events, "decode_batch_for_index")
                                        else [])
    no_l3 = [(w, seq, events.encode_batch([e for e in events.decode_batch(p).events
                                           if getattr(e, "medium", None) != events.MEDIUM_L3], ts=0.0))
             for w, seq, p in received]
    for name, batches in (("all events", received), ("L1/L2 events only", no_l3)):
        for dec in decoders:
            total_s, decode_s = _replay(batches, dec, events.unpack_seq, PrefixIndex)
            print(f"{name}, {dec.__name__}: {total_s * 1e3 / n:.1f} ms CPU per request "
                  f"(decode {decode_s * 1e3 / n:.1f})")


def _replay(batches, dec, unpack_seq, index_type) -> tuple[float, float]:
    """(CPU seconds to decode and apply every batch to a fresh index, of which decoding), min of 3."""
    best = (float("inf"), 0.0)
    for _ in range(3):
        idx = index_type()
        decode_s = 0.0
        t0 = time.process_time()
        for w, seq, payload in batches:
            t1 = time.process_time()
            batch = dec(payload)
            decode_s += time.process_time() - t1
            idx.apply_batch(w, unpack_seq(seq), batch)
        best = min(best, (time.process_time() - t0, decode_s))
    return best

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["record", "replay"])
    p.add_argument("path")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=131000)
    a = p.parse_args()
    if a.mode == "record":
        record(a.path, a.requests, a.prompt_tokens)
    else:
        replay(a.path)


if __name__ == "__main__":
    main()
