"""Predict a live torch deployment's TTFT with the calibrated cost model, then measure it.

For each deployment (``pd:PRE:PREFILL:DECODE`` / ``cpd:PRE:PREFILL:DECODE``):

(a) **prediction**: the engine-object simulator (:class:`cpd.sim.engine_sim.EngineSimulator`:
    real engines with the modeled executor on a virtual clock, the live router's prefix index
    and ``route``) runs the trace slice with :class:`cpd.costmodel.calibrated.CalibratedCostModel`
    step times — "SmolLM2 on this CPU" — and the live deployment's engine settings (the
    ``engine`` / ``kv`` defaults of :mod:`cpd.config`: block size, budgets, L1 blocks, L2 bytes);
(b) **measurement** (``--live``): ``cpd serve`` with the real model (torch executor, the deploy
    default of ``cores // workers`` threads, at least 1, per worker), then ``cpd bench``
    replaying the same slice (same ``ReplayOptions``: same requests, arrivals, prompt lengths
    and output caps), then the server is stopped;

and reports TTFT p50/p90 of both and the relative error ``(predicted - measured) / measured``.
Contention, measured (``slowdown``): before and after each live bench, 8 requests one at a time
(32-512 tokens, no queue) give the ratio of their wall latency to the model's prefill time; the
run is then also predicted with every modeled time multiplied by the median over the 16
(``predicted_at_slowdown``). That
prediction knows how much slower the live stack is *now* than the profile, not why.
A load-independent check rides along: each live worker's CPU seconds (user + system, all its
threads, from ``/proc``) over the bench, next to the simulator's busy seconds of that worker
(the sum of its modeled step and transfer times): the model's step costs, compared where
other processes' time slices do not enter.
Percentiles: :func:`cpd.bench.report.stats` for both sides. The 1-minute load average is
sampled every 5 s during each live run (other processes on a shared machine slow it down).

What the plain prediction does *not* model (each makes the live run slower than predicted): CPU
sharing between worker processes (the simulator gives each worker its own core unless
``--cores N``: then the workers share N cores, :mod:`cpd.sim.core_share`) and with the router,
the bench client and anything else running; HTTP / router / event-loop overheads and the prefill
worker's staging copy of the KV for the handoff (before it answers). ``--overhead-from
PROBE_JSON`` fits those per-request costs on a ``--probe`` run (:func:`fit_live_overhead`) and
adds a second prediction with them (``predicted_with_overhead``). ``--measured-from OUT_JSON``
predicts again for the live runs of an earlier output (no live run).

Usage::

    .venv/bin/python benchmarks/predict_live_ttft.py --profile cpd/costmodel/profiles/smollm2-135m-vm-t1.json \\
        --requests 120 --time-scale 0.3 --max-output-tokens 4 --configs pd:0:1:1,cpd:1:1:1 \\
        [--live --rounds 1 --port 8047] --out docs/results/calibration/predict.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cpd.bench.report import stats  # noqa: E402
from cpd.config import Config, routing_config  # noqa: E402
from cpd.costmodel.calibrated import CalibratedCostModel  # noqa: E402
from cpd.engine.scheduler import SchedulerConfig  # noqa: E402
from cpd.policy.routing import LinearCostModel  # noqa: E402
from cpd.sim.engine_sim import EngineClusterSpec, EngineInstanceSpec, EngineSimulator  # noqa: E402
from cpd.sim.workload import trace_workload  # noqa: E402
from cpd.traces import ReplayOptions, read_mooncake  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared/data/traces/mooncake/conversation_trace.jsonl"


def parse_config(s: str) -> tuple[str, int, int, int]:
    """``"pd:0:1:1"`` → ``("pd", pre-prefill, prefill, decode)``."""
    topo, pre, pf, dc = s.split(":")
    if topo not in ("pd", "cpd") or (topo == "pd" and int(pre)):
        raise ValueError(f"bad config {s!r}: want pd:0:P:D or cpd:PP:P:D")
    return topo, int(pre), int(pf), int(dc)


def replay_options(a: argparse.Namespace) -> ReplayOptions:
    """The options ``cpd bench`` builds from the same flags (context cap: the model's 8192)."""
    return ReplayOptions(tokens_per_block=a.tokens_per_hash_id, time_scale=a.time_scale, start=a.start,
                         max_requests=a.requests,
                         max_output_tokens=a.max_output_tokens, context_len=a.context_len,
                         spread_ticks=a.spread_ticks)


def predict(cost: CalibratedCostModel, cfg_s: str, a: argparse.Namespace, request_overhead_s: float = 0.0) -> dict[str, Any]:
    """Simulated TTFT of the slice on one deployment (module docstring, (a)); ``a.cores`` > 0 shares
    that many cores among the workers (:mod:`cpd.sim.core_share`); ``request_overhead_s`` is
    worker time per request (:func:`fit_live_overhead`)."""
    topo, pre, pf, dc = parse_config(cfg_s)
    eng = Config().engine
    kv = Config().kv
    bs = eng.block_size
    sched = SchedulerConfig(max_num_batched_tokens=eng.max_num_batched_tokens, max_num_seqs=eng.max_num_seqs,
                            max_prefill_chunk_tokens=eng.max_prefill_chunk_tokens, block_size=bs)
    insts = [EngineInstanceSpec(role, cost, sched, eng.num_blocks, int(kv.host_kv_bytes))
             for role, n in (("pre-prefill", pre), ("prefill", pf), ("decode", dc)) for _ in range(n)]
    # the live router: `cpd serve --topology T` with every router default (adaptive routing), its
    # cost estimates starting where the live router's start (LinearCostModel's defaults, as
    # cpd.router.app builds them) and learned from the simulated prefills as live
    cfg = Config.model_validate({"deployment": {"topology": topo}})
    routing = routing_config(cfg, bs)
    router_cost = LinearCostModel(kv_bytes_per_token=cost.kv_bytes_per_token)
    l3_bytes = (1 << 40) if topo == "cpd" else 0  # live: a fresh unlimited file store; pd never writes it
    cluster = EngineClusterSpec(tuple(insts), routing, router_cost, bs, l3_bytes, a.kv_event_delay_s,
                                learn_router_cost=True, fit_router_cost=cfg.router.prefill_cost_fit,
                                cores=a.cores, request_overhead_s=request_overhead_s)
    reqs = trace_workload(read_mooncake(a.trace), replay_options(a), sim_block_tokens=bs)
    t = time.perf_counter()
    sim = EngineSimulator(cluster, reqs).run()
    wall = time.perf_counter() - t
    recs = [r for r in sim.rec if r is not None]
    ttft = [r["ttft_t"] - r["arrival"] for r in recs if r["ttft_t"] is not None]
    busy = sim.busy_s()
    span = max((r["done_t"] or 0.0) for r in recs) if recs else 0.0
    return {"requests": len(reqs), "completed": len(ttft), "ttft_s": stats(ttft),
            "busy_s": {w: round(b, 2) for w, b in busy.items()},
            "pools": {p: sum(1 for r in recs if r["pool"] == p) for p in sorted({r["pool"] for r in recs})},
            "busy_fraction": {w: round(b / max(span, 1e-9), 3) for w, b in busy.items()},
            "simulated_s": round(span, 2), "wall_s": round(wall, 2),
            "prompt_tokens": sum(r.prompt_tokens for r in reqs)}


class LoadSampler(threading.Thread):
    """The 1-minute load average every ``every_s`` seconds until stopped."""

    def __init__(self, every_s: float = 5.0):
        super().__init__(daemon=True)
        self.every_s, self.samples, self._stop_ev = every_s, [], threading.Event()

    def run(self) -> None:
        while not self._stop_ev.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self._stop_ev.wait(self.every_s)

    def stop(self) -> list[float]:
        self._stop_ev.set()
        self.join()
        return self.samples


LIVE_PREFIX = {"pp": "pre-prefill", "p": "prefill", "d": "decode"}


def _stat(pid: int) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds user + system)`` of ``pid`` from ``/proc`` (None if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2:].split()
    return int(f[1]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds so far of every process under ``root`` that is a worker (named as the simulator
    names it: ``p0`` → ``prefill-0``) or the router; the thread CPU time of all their threads."""
    stats = {int(d): st for d in os.listdir("/proc") if d.isdigit() and (st := _stat(int(d))) is not None}
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = {}, list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [x.decode(errors="replace") for x in argv]
        if "--worker-id" in args:
            wid = args[args.index("--worker-id") + 1]
            pre = wid.rstrip("0123456789")
            out[f"{LIVE_PREFIX.get(pre, pre)}-{wid[len(pre):]}"] = stats[pid][1]
        elif "cpd.router.main" in args:
            out["router"] = stats[pid][1]
    return out


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def warm_up(url: str, n: int = 3) -> None:
    """A few short requests (token-id prompts unrelated to the trace) so that the workers' first
    forward passes (allocations, kernel set-up) are not charged to the trace's first requests,
    as the calibration's warm-up step is not charged to its points."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    for i in range(n):
        body = json.dumps({"model": model, "prompt": [100 + i * 7 + k for k in range(64 * (i + 1))],
                           "max_tokens": 4}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def service_probe(url: str, cost: CalibratedCostModel, root_pid: int, lengths: tuple[int, ...], reps: int,
                  seed: int = 1) -> list[dict[str, Any]]:
    """Service time without queueing: one request at a time (random token-id prompts of
    ``lengths``, ``max_tokens`` 1 so the prefill worker answers alone): the wall latency and
    the CPU seconds of each process, next to the model's prefill time of the same chunks
    (``max_prefill_chunk_tokens`` per step)."""
    import random
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    chunk = Config().engine.max_prefill_chunk_tokens
    rng = random.Random(seed)
    rows = []
    for rep in range(reps):
        for n in lengths:
            prompt = [rng.randrange(10, 40000) for _ in range(n)]
            c0 = tree_cpu_s(root_pid)
            t = time.perf_counter()
            _complete(url, model, prompt, 1)
            wall = time.perf_counter() - t
            c1 = tree_cpu_s(root_pid)
            pred = sum(cost.prefill_time_s(min(chunk, n - k), k) for k in range(0, n, chunk))
            rows.append({"n": n, "rep": rep, "wall_s": round(wall, 4), "predicted_s": round(pred, 4),
                         "cpu_s": {k: round(v - c0.get(k, 0.0), 3) for k, v in c1.items()},
                         "loadavg_1m": round(os.getloadavg()[0], 2)})
    return rows


def slowdown(rows: list[dict[str, Any]]) -> float:
    """Median of wall latency / modeled prefill time over probe rows: how much slower than the
    profile the live stack (contention from other processes + HTTP/router/worker overheads) is now."""
    import statistics
    return round(statistics.median(r["wall_s"] / r["predicted_s"] for r in rows), 3)


def probe(cost: CalibratedCostModel, a: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    """:func:`service_probe` on a live ``pd`` 1 + 1 over 32..2048-token prompts."""
    url = f"http://127.0.0.1:{a.port}"
    cpd = str(ROOT / ".venv/bin/cpd")
    log = open(out_dir / "probe.serve.log", "w")
    serve = subprocess.Popen([cpd, "serve", "--topology", "pd", "--prefill", "1", "--decode", "1", "--port", str(a.port)],
                             cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("cpd serve did not come up")
            time.sleep(1)
        warm_up(url)
        rows = service_probe(url, cost, serve.pid, (32, 128, 256, 512, 1024, 2048), a.probe_reps)
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(60)
        log.close()
    return rows


def measure(cfg_s: str, a: argparse.Namespace, out_dir: Path, tag: str, cost: CalibratedCostModel) -> dict[str, Any]:
    """One live run (module docstring, (b)); the bench JSON and logs go to ``out_dir``."""
    topo, pre, pf, dc = parse_config(cfg_s)
    url = f"http://127.0.0.1:{a.port}"
    if _healthy(url):
        raise RuntimeError(f"port {a.port} already serves")
    cpd = str(ROOT / ".venv/bin/cpd")
    pools = ["--prefill", str(pf), "--decode", str(dc)] + (["--pre-prefill", str(pre)] if topo == "cpd" else [])
    serve_cmd = [cpd, "serve", "--topology", topo, *pools, "--port", str(a.port), "--log-dir", str(out_dir / f"{tag}-logs")]
    bench_out = out_dir / f"{tag}.bench.json"
    bench_cmd = [cpd, "bench", "--url", url, "--trace", str(a.trace), "--start", str(a.start),
                 "--max-requests", str(a.requests),
                 "--tokens-per-hash-id", str(a.tokens_per_hash_id), "--time-scale", str(a.time_scale),
                 "--max-output-tokens", str(a.max_output_tokens), "--label", tag, "--out", str(bench_out),
                 "--spread-ticks" if a.spread_ticks else "--bursty-ticks"]
    log = open(out_dir / f"{tag}.serve.log", "w")
    serve = subprocess.Popen(serve_cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cpd serve did not come up (see {log.name})")
            time.sleep(1)
        warm_up(url)
        probe_rows = service_probe(url, cost, serve.pid, (32, 128, 256, 512), 2)
        uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        sampler = LoadSampler()
        sampler.start()
        cpu0 = tree_cpu_s(serve.pid)
        t = time.monotonic()
        with open(out_dir / f"{tag}.bench.txt", "w") as bl:
            subprocess.run(bench_cmd, cwd=ROOT, stdout=bl, stderr=subprocess.STDOUT, check=True, timeout=a.bench_timeout_s)
        bench_s = time.monotonic() - t
        cpu1 = tree_cpu_s(serve.pid)
        load = sampler.stop()
        with urllib.request.urlopen(url + "/cpd/requests", timeout=30) as r:  # per request: the worker's times
            (out_dir / f"{tag}.requests.json").write_bytes(r.read())
        probe_after = service_probe(url, cost, serve.pid, (32, 128, 256, 512), 2, seed=2)
        uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
        log.close()
    doc = json.loads(bench_out.read_text())
    s = doc["summary"]
    return {"ttft_s": s["all"]["ttft"], "errors": s.get("errors"), "requests": s.get("requests"),
            "bench_wall_s": round(bench_s, 1), "loadavg_1m_samples": load,
            "slowdown": slowdown(probe_rows + probe_after), "slowdown_before": slowdown(probe_rows),
            "slowdown_after": slowdown(probe_after), "probe": probe_rows + probe_after,
            "cpu_s": {k: round(v - cpu0.get(k, 0.0), 2) for k, v in sorted(cpu1.items())},
            "loadavg_1m_mean": round(sum(load) / max(1, len(load)), 2), "uptime_before": uptime_before,
            "uptime_after": uptime_after, "serve_cmd": " ".join(serve_cmd[1:]), "bench_cmd": " ".join(bench_cmd[1:])}


def fit_live_overhead(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The live stack against the profile, from :func:`service_probe` rows (one request at a time):
    least squares ``wall_s = request_s + factor * predicted_s`` (``request_s`` clamped at 0, then
    ``factor`` refitted through the origin). ``factor`` scales every modeled time
    (:meth:`CalibratedCostModel.scaled`), ``request_s`` is worker time per request
    (``EngineClusterSpec.request_overhead_s``): the probe shows the prefill worker's CPU seconds
    equal to the wall time, so the excess is that worker's work, not latency elsewhere."""
    xs = [r["predicted_s"] for r in rows]
    ys = [r["wall_s"] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    factor = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    request_s = my - factor * mx
    if request_s < 0:
        request_s, factor = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return {"request_s": round(request_s, 4), "factor": round(factor, 4), "num_rows": n}


def predict_all(cost: CalibratedCostModel, cfg_s: str, a: argparse.Namespace,
                overhead: dict[str, float] | None) -> dict[str, Any]:
    """The plain prediction and, with a fitted live overhead, the prediction with it."""
    out = {"predicted": predict(cost, cfg_s, a)}
    if overhead is not None:
        out["predicted_with_overhead"] = predict(cost.scaled(overhead["factor"]), cfg_s, a, overhead["request_s"])
    return out


def rel_err(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or not meas else round((pred - meas) / meas, 4)


def check_same_slice(earlier: dict[str, Any], now: dict[str, Any]) -> None:
    """``--measured-from``: the earlier runs replayed the slice the flags describe now."""
    defaults = {"start": 0}  # outputs written before the flag existed replayed from the first row
    diff = {k: (earlier.get(k, defaults.get(k)), v) for k, v in now.items()
            if k != "trace" and earlier.get(k, defaults.get(k)) != v}
    if diff:
        raise SystemExit(f"--measured-from: its slice differs from the flags (earlier, now): {diff}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--start", type=int, default=0, help="first trace row of the slice")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--tokens-per-hash-id", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=0.3)
    ap.add_argument("--max-output-tokens", type=int, default=4)
    ap.add_argument("--context-len", type=int, default=8192, help="cpd bench's cap (the model card's max_model_len)")
    ap.add_argument("--kv-event-delay-s", type=float, default=0.02)
    ap.add_argument("--spread-ticks", action="store_true",
                    help="spread each 3 s trace tick's requests over the tick, in trace order (both sides): "
                         "a burst sent at once reaches the worker in the network's order, which no model predicts")
    ap.add_argument("--configs", default="pd:0:1:1,cpd:1:1:1")
    ap.add_argument("--live", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="live runs per config (interleaved: A B A B ...)")
    ap.add_argument("--port", type=int, default=8047)
    ap.add_argument("--bench-timeout-s", type=float, default=900)
    ap.add_argument("--probe", action="store_true", help="only the no-queue service-time probe (see probe())")
    ap.add_argument("--probe-reps", type=int, default=3)
    ap.add_argument("--cores", type=int, default=0,
                    help="the workers share this many cores in the simulator (cpd.sim.core_share); 0: a core each")
    ap.add_argument("--overhead-from", type=Path, default=None, metavar="PROBE_JSON",
                    help="a --probe output: fit the live stack's per-request time and factor (fit_live_overhead) "
                         "and predict with them too (predicted_with_overhead)")
    ap.add_argument("--measured-from", type=Path, default=None, metavar="OUT_JSON",
                    help="predict again for the live runs of an earlier --live output (its slice options must "
                         "match the flags given) instead of running live")
    ap.add_argument("--out", type=Path, required=True)
    return ap


def main() -> None:
    a = build_parser().parse_args()
    cost = CalibratedCostModel.load(a.profile)
    if a.probe:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"profile": a.profile, "probe": probe(cost, a, a.out.parent)}, indent=1) + "\n")
        return
    configs = a.configs.split(",")
    out_dir = a.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"profile": a.profile, "machine": cost.profile.get("machine"),
                           "slice": {"trace": str(a.trace), **{k: getattr(a, k) for k in (
                               "start", "requests", "tokens_per_hash_id", "time_scale", "max_output_tokens", "context_len",
                               "spread_ticks")}},
                           "cores": a.cores, "configs": {}}
    overhead = None
    if a.overhead_from is not None:
        overhead = fit_live_overhead(json.loads(a.overhead_from.read_text())["probe"])
        res["live_overhead"] = {"from": str(a.overhead_from), **overhead}
        print(f"live overhead from {a.overhead_from}: {overhead}", flush=True)
    earlier = json.loads(a.measured_from.read_text()) if a.measured_from is not None else None
    if earlier is not None:
        check_same_slice(earlier["slice"], res["slice"])
    for c in configs:
        res["configs"][c] = {**predict_all(cost, c, a, overhead), "measured": []}
        if earlier is not None:
            res["measured_from"] = str(a.measured_from)
            for m in earlier["configs"][c]["measured"]:  # its slowdown prediction again, with today's options
                m["predicted_at_slowdown"] = predict(cost.scaled(m["slowdown"]), c, a)
                res["configs"][c]["measured"].append(m)
        p = res["configs"][c]["predicted"]
        print(f"{c}: predicted TTFT p50 {p['ttft_s']['p50']:.3f} s p90 {p['ttft_s']['p90']:.3f} s "
              f"busy {p['busy_fraction']} (sim wall {p['wall_s']} s)", flush=True)
    if a.live:
        for rnd in range(a.rounds):
            for c in configs:
                tag = f"{c.replace(':', '-')}-r{rnd + 1}"
                m = measure(c, a, out_dir, tag, cost)
                m["predicted_at_slowdown"] = predict(cost.scaled(m["slowdown"]), c, a)
                res["configs"][c]["measured"].append(m)
                q = m["predicted_at_slowdown"]["ttft_s"]
                print(f"{c} round {rnd + 1}: slowdown {m['slowdown']}, predicted at it p50 {q['p50']:.3f} p90 "
                      f"{q['p90']:.3f}", flush=True)
                print(f"{c} round {rnd + 1}: measured TTFT p50 {m['ttft_s']['p50']:.3f} s p90 "
                      f"{m['ttft_s']['p90']:.3f} s, load {m['loadavg_1m_mean']}, CPU s {m['cpu_s']} "
                      f"(predicted busy s {res['configs'][c]['predicted']['busy_s']})", flush=True)
                a.out.write_text(json.dumps(res, indent=1) + "\n")
    for c, r in res["configs"].items():
        for key, err_key in (("predicted", "error"), ("predicted_with_overhead", "error_with_overhead")):
            if key in r:
                p = r[key]["ttft_s"]
                r[err_key] = [{"p50": rel_err(p["p50"], m["ttft_s"]["p50"]), "p90": rel_err(p["p90"], m["ttft_s"]["p90"])}
                              for m in r["measured"]]
                print(f"{c}: {err_key} per round {r[err_key]}")
        r["error_at_slowdown"] = [
            {"slowdown": m["slowdown"],
             "p50": rel_err(m["predicted_at_slowdown"]["ttft_s"]["p50"], m["ttft_s"]["p50"]),
             "p90": rel_err(m["predicted_at_slowdown"]["ttft_s"]["p90"], m["ttft_s"]["p90"])} for m in r["measured"]]
        print(f"{c}: with the measured slowdown {r['error_at_slowdown']}")
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
