"""Soak benchmark (not a test): long trace replay near capacity, one worker killed midway.

What it does, in one run against a real ``cpd serve`` (real model by default):

1. starts ``cpd serve`` (supervised: a dead worker is restarted) as a child process;
2. **capacity probe**: sends ``--probe-requests`` trace requests at once and takes
   ``capacity = completed / makespan`` (requests per second);
3. **soak**: replays the following trace requests open-loop at ``--load-fraction`` × capacity
   (the trace's own arrival pattern, time stretched; never dropping requests) for ``--duration-s``;
4. at ``--kill-at-s`` SIGKILLs one worker of ``--kill-role`` and records when the supervisor has it
   serving again;
5. samples the RSS of the router and of every worker every ``--sample-every-s``.

Writes ``OUT/soak.json`` (settings, probe, per-minute TTFT and errors, RSS at start and end per
process, the kill and restart times) and ``OUT/ttft_over_time.png``.

Usage::

    .venv/bin/python benchmarks/soak.py --out docs/results/soak [--duration-s 1200] [--model DIR]
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
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def processes(serve_pid: int) -> dict[str, int]:
    """``{"router": pid, "<worker id>": pid}`` of the serve process's children."""
    out = {}
    for pid in _children(serve_pid):
        cmd = _cmdline(pid)
        if "cpd.router.main" in cmd:
            out["router"] = pid
        elif "--worker-id" in cmd:
            out[cmd.split("--worker-id ")[1].split()[0]] = pid
    return out


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("deployment did not become healthy")


def build(url: str, model_dir: str, start: int, n: int, time_scale: float, a) -> list:
    from cpd.bench.trace import TraceConfig, load_requests, vocab_from_tokenizer
    cfg = TraceConfig(trace=str(a.trace), start=start, max_requests=n, tokens_per_hash_id=a.tokens_per_hash_id,
                      time_scale=time_scale, spread_ticks=True, max_output_tokens=a.max_output_tokens,
                      context_len=a.context_len)
    return load_requests(cfg, vocab_from_tokenizer(model_dir))


def probe_capacity(url: str, model_dir: str, a) -> dict:
    from cpd.bench.client import run_replay
    reqs = build(url, model_dir, 0, a.probe_requests, 1e6, a)  # all arrive at once
    res = run_replay(url, reqs, timeout_s=a.timeout_s)
    ok = [r for r in res.records if r.ok]
    return {"requests": len(reqs), "completed": len(ok), "makespan_s": res.duration_s,
            "capacity_rps": len(ok) / res.duration_s if res.duration_s > 0 else 0.0}


def soak_requests(url: str, model_dir: str, a, target_rps: float) -> list:
    n = max(10, int(target_rps * a.duration_s))
    natural = build(url, model_dir, a.probe_requests, n, 1.0, a)
    span_s = natural[-1].arrival_s - natural[0].arrival_s
    time_scale = span_s * target_rps / n  # arrival = trace time / time_scale; lasts n / target_rps
    return build(url, model_dir, a.probe_requests, n, max(time_scale, 1e-6), a)


class Sampler(threading.Thread):
    """RSS of every process every ``every_s``; kills one worker at ``kill_at_s``."""

    def __init__(self, serve_pid: int, url: str, every_s: float, kill_at_s: float, kill_role: str):
        super().__init__(daemon=True)
        self.serve_pid, self.url, self.every_s = serve_pid, url, every_s
        self.kill_at_s, self.kill_role = kill_at_s, kill_role
        self.t0 = time.monotonic()
        self.samples: list[dict] = []
        self.kill: dict = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            t = time.monotonic() - self.t0
            procs = processes(self.serve_pid)
            self.samples.append({"t_s": t, "rss_bytes": {k: _rss_bytes(p) for k, p in procs.items()}})
            if not self.kill and t >= self.kill_at_s:
                self._kill(procs)
            if self.kill and "back_s" not in self.kill:
                self._check_back(procs)

    def _kill(self, procs: dict[str, int]) -> None:
        wid = sorted(w for w in procs if w != "router" and self._role(w) == self.kill_role)[0]
        os.kill(procs[wid], signal.SIGKILL)
        self.kill = {"worker_id": wid, "pid": procs[wid], "at_s": time.monotonic() - self.t0}

    def _role(self, wid: str) -> str:
        return {"pp": "pre-prefill", "p": "prefill", "d": "decode"}[wid.rstrip("0123456789")]

    def _check_back(self, procs: dict[str, int]) -> None:
        wid = self.kill["worker_id"]
        if procs.get(wid) not in (None, self.kill["pid"]):
            try:
                state = httpx.get(f"{self.url}/cpd/workers", timeout=2).json().get(wid, {})
            except (httpx.HTTPError, ValueError):
                return
            if state.get("healthy"):
                self.kill["back_s"] = time.monotonic() - self.t0
                self.kill["new_pid"] = procs[wid]


def per_minute(records, t_kill_s: float | None) -> list[dict]:
    out = []
    end = max((r.send_s or 0) for r in records) if records else 0
    for m in range(int(end // 60) + 1):
        rs = [r for r in records if r.send_s is not None and m * 60 <= r.send_s < (m + 1) * 60]
        ttft = [r.ttft_s for r in rs if r.ok and r.ttft_s is not None]
        out.append({"minute": m, "requests": len(rs), "errors": sum(not r.ok for r in rs),
                    "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
                    "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft else None})
    return out


def plot(records, kill: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    bad = [r for r in records if not r.ok]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.scatter([r.send_s for r in ok], [r.ttft_s for r in ok], s=4, label="TTFT (ok)")
    if bad:
        ax.scatter([r.send_s for r in bad], [0] * len(bad), s=12, c="red", marker="x", label="error")
    if kill:
        ax.axvline(kill["at_s_replay"], color="k", ls="--", label=f"SIGKILL {kill['worker_id']}")
    ax.set_xlabel("replay time (s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rss_table(samples: list[dict], warmup_s: float) -> dict:
    """RSS per process at the first sample, after the warm-up (pools and caches filled) and at the
    end: growth after the warm-up is what a leak looks like."""
    if not samples:
        return {}
    first, last = samples[0]["rss_bytes"], samples[-1]["rss_bytes"]
    warm = next((x["rss_bytes"] for x in samples if x["t_s"] >= warmup_s), last)
    return {k: {"start_bytes": first.get(k), "after_warmup_bytes": warm.get(k), "end_bytes": last.get(k)}
            for k in sorted(set(first) | set(last))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default=None, help="model dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--topology", default="cpd")
    ap.add_argument("--port", type=int, default=8047)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--tokens-per-hash-id", type=int, default=8)
    ap.add_argument("--max-output-tokens", type=int, default=8)
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--probe-requests", type=int, default=60)
    ap.add_argument("--load-fraction", type=float, default=0.8)
    ap.add_argument("--duration-s", type=float, default=1200)
    ap.add_argument("--kill-at-s", type=float, default=None, help="default: half the duration")
    ap.add_argument("--kill-role", default="prefill")
    ap.add_argument("--sample-every-s", type=float, default=10)
    ap.add_argument("--timeout-s", type=float, default=120)
    a = ap.parse_args()
    from cpd.engine.weights import default_model_dir
    model_dir = a.model or str(default_model_dir())
    a.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{a.port}"
    serve = subprocess.Popen([sys.executable, "-m", "cpd.cli", "serve", "--topology", a.topology, "--model", model_dir,
                              "--port", str(a.port), "--log-dir", str(a.out / "logs")],
                             stdout=open(a.out / "serve.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_healthy(url, 600)
        probe = probe_capacity(url, model_dir, a)
        print("probe", probe, flush=True)
        target = a.load_fraction * probe["capacity_rps"]
        reqs = soak_requests(url, model_dir, a, target)
        kill_at = a.kill_at_s if a.kill_at_s is not None else a.duration_s / 2
        sampler = Sampler(serve.pid, url, a.sample_every_s, kill_at, a.kill_role)
        from cpd.bench.client import run_replay
        sampler.start()
        t_replay0 = time.monotonic()
        res = run_replay(url, reqs, timeout_s=a.timeout_s)
        sampler.stop.set()
        sampler.join(5)
        kill = dict(sampler.kill)
        if kill:
            kill["at_s_replay"] = kill["at_s"] - (t_replay0 - sampler.t0)
        summarize_and_write(a, probe, target, reqs, res, sampler, kill)
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()


def summarize_and_write(a, probe, target, reqs, res, sampler, kill) -> None:
    from cpd.bench.report import summarize
    recs = res.records
    errors: dict[str, int] = {}
    for r in recs:
        if not r.ok:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    doc = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "probe": probe, "target_rps": target, "num_requests": len(reqs), "duration_s": res.duration_s,
           "summary": summarize(recs, res.duration_s), "errors": errors, "kill": kill,
           "per_minute": per_minute(recs, kill.get("at_s_replay")), "rss": rss_table(sampler.samples, min(180.0, a.duration_s / 4)),
           "rss_samples": sampler.samples}
    (a.out / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
    plot(recs, kill, a.out / "ttft_over_time.png")
    print(json.dumps({k: doc[k] for k in ("probe", "target_rps", "num_requests", "errors", "kill", "rss")},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
