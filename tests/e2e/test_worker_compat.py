"""Issue 7 §7: workers whose KV namespace or context does not fit the deployment are refused.

Real processes: a tiny-model deployment, extra worker processes started by hand (one with
``--block-size 32``, one decode worker whose ``--num-blocks`` leaves it a 64-token context) and a
second router started from a hand-written config that lists them next to the good workers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cpd.deploy import free_port
from cpd.kv.block_hash import Namespace
from cpd.router.compat import Requirements, needs_check, refusal_reason
from cpd.router.workers import WorkerInfo

import deploy_util

NS = Namespace("m", "w", "t", block_size=16)
REQ = Requirements(NS, 2048)


def _info(**over):
    info = {"role": "prefill", "namespace": dataclasses.asdict(NS), "max_model_len": 2048, "boot_id": "b1"}
    info.update(over)
    return info


# ----------------------------------------------------------------------------- pure verdicts

@pytest.mark.parametrize("field,value", [("model_id", "other"), ("weights_digest", "w2"), ("tokenizer_digest", "t2"),
                                         ("block_size", 32), ("kv_dtype", "bfloat16"), ("kv_layout", "x"),
                                         ("adapter_id", "lora")])
def test_every_namespace_field_mismatch_is_refused(field, value):
    ns = dict(dataclasses.asdict(NS), **{field: value})
    reason = refusal_reason(_info(namespace=ns), "prefill", REQ)
    assert reason is not None and field in reason and repr(value) in reason


def test_capacity_role_and_missing_fields_are_refused():
    assert refusal_reason(_info(), "prefill", REQ) is None
    assert refusal_reason(_info(max_model_len=4096), "prefill", REQ) is None  # larger is fine
    assert "max_model_len 2047" in refusal_reason(_info(max_model_len=2047), "prefill", REQ)
    assert "role" in refusal_reason(_info(), "decode", REQ)
    assert refusal_reason(_info(namespace=None), "prefill", REQ) is not None
    assert refusal_reason(_info(max_model_len=None), "prefill", REQ) is not None
    ns = dict(dataclasses.asdict(NS), extra_field="x")  # a field the router does not know
    assert refusal_reason(_info(namespace=ns), "prefill", REQ) is not None


def test_recheck_after_unhealthy_restart_or_refusal():
    w = WorkerInfo("p0", "prefill", "http://x", "tcp://x", state="accepted", boot_id="b1")
    w.last_load = {"boot_id": "b1"}
    assert not needs_check(w, was_healthy=True)
    assert needs_check(w, was_healthy=False)          # came back after being unhealthy
    w.last_load = {"boot_id": "b2"}
    assert needs_check(w, was_healthy=True)           # restarted between two polls
    w.last_load, w.state = {"boot_id": "b1"}, "refused"
    assert needs_check(w, was_healthy=True)           # refused: checked at every poll
    assert not dataclasses.replace(w, state="refused").usable


# ----------------------------------------------------------------------------- live

class Proc:
    """A process started by the test, with its READY line (workers) read from stdout."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with open(log, "w") as f:
            self.p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=f, text=True,
                                      env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        self.ready: dict = {}
        self._got = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("READY ") and not self._got.is_set():
                self.ready = json.loads(line[6:])
                self._got.set()
        self._got.set()

    def wait_ready(self, timeout_s=180.0) -> dict:
        self._got.wait(timeout_s)
        assert self.ready, f"no READY (exit {self.p.poll()}): {self.log.read_text()[-2000:]}"
        return self.ready

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


def _worker(dep, tmp: Path, wid: str, role: str, port: int, eport: int, *extra: str, log: str = "") -> Proc:
    return Proc(["-m", "cpd.worker.main", "--role", role, "--worker-id", wid, "--model", dep.model_dir,
                 "--port", str(port), "--events-port", str(eport), "--kv-store", dep.kv_store,
                 "--host-kv-bytes", str(16 << 20), "--torch-threads", "1", *extra], tmp / f"{log or wid}.log")


def _entry(wid, role, port, eport):
    return {"worker_id": wid, "role": role, "url": f"http://127.0.0.1:{port}",
            "events_endpoint": f"tcp://127.0.0.1:{eport}"}


def _wait(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {last!r}")


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compat")
    dep = deploy_util.start(tiny_model_dir)
    procs: list[Proc] = []
    try:
        ports = {k: (free_port(), free_port()) for k in ("pbad", "dsmall")}
        procs.append(_worker(dep, tmp, "pbad", "prefill", *ports["pbad"], "--block-size", "32"))
        procs.append(_worker(dep, tmp, "dsmall", "decode", *ports["dsmall"], "--num-blocks", "4"))
        for p in procs:
            p.wait_ready()
        w0 = dep.workers[0]
        port = free_port()
        cfg = {"model": {"dir": dep.model_dir, "name": dep.model_name}, "deployment": {"topology": "cpd"},
               "router": {"workers": [_entry(w["worker_id"], w["role"], w["port"], w["events_port"])
                                      for w in dep.workers]
                          + [_entry("pbad", "prefill", *ports["pbad"]), _entry("dsmall", "decode", *ports["dsmall"])],
                          "served": {"namespace": w0["namespace"], "max_model_len": w0["max_model_len"],
                                     "kv_bytes_per_token": w0["kv_bytes_per_token"]},
                          "host": "127.0.0.1", "port": port, "max_request_body_bytes": 1 << 20}}
        (tmp / "router.json").write_text(json.dumps(cfg))
        router = Proc(["-m", "cpd.router.main", "--config", str(tmp / "router.json")], tmp / "router.log")
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _get(url, "/health") is not None, 120, "router up")
        yield {"dep": dep, "url": url, "tmp": tmp, "ports": ports, "procs": procs, "router": router,
               "max_model_len": w0["max_model_len"]}
    finally:
        for p in procs:
            p.stop()
        dep.stop()


def _load(setup, wid):
    return httpx.get(f"http://127.0.0.1:{setup['ports'][wid][0]}/load", timeout=5).json()


def _get(url, path):
    try:
        return httpx.get(url + path, timeout=5)
    except httpx.HTTPError:
        return None


def test_incompatible_workers_refused_and_never_used(setup):
    url, mml = setup["url"], setup["max_model_len"]
    workers = httpx.get(url + "/cpd/workers", timeout=5).json()
    assert workers["pbad"]["state"] == "refused" and "block_size=32" in workers["pbad"]["reason"]
    assert workers["dsmall"]["state"] == "refused" and "max_model_len 64" in workers["dsmall"]["reason"]
    good = [w for w in workers if w not in ("pbad", "dsmall")]
    assert all(workers[w]["state"] == "accepted" and workers[w]["reason"] is None for w in good)
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 200  # the good workers serve
    assert set(health.json()["refused"]) == {"pbad", "dsmall"}
    assert health.json()["workers"]["pbad"] is False and health.json()["workers"]["dsmall"] is False
    log = (setup["tmp"] / "router.log").read_text()
    assert "refusing worker pbad" in log and "refusing worker dsmall" in log

    # A 100-token prompt with max_tokens far beyond dsmall's 64-token context: served in full by
    # the fitting decode worker, never cut short; a request over the router's limit: 400 up front.
    model = setup["dep"].model_name
    for i in range(6):
        body = {"model": model, "prompt": deploy_util.random_prompt(700 + i, 100), "max_tokens": 120,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 120 and out["choices"][0]["finish_reason"] == "length"
        rec = httpx.get(url + "/cpd/requests", timeout=5).json()[out["id"]]
        assert rec["prefill_worker"] != "pbad" and rec["decode_worker"] != "dsmall", rec
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": [5] * 100, "max_tokens": mml},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # never reached: pbad staged no handoff, dsmall fetched none
    sent = _load(setup, "pbad")["handoff"]
    assert sent["staged_shm"] + sent["staged_tcp"] == 0, sent
    got = _load(setup, "dsmall")["handoff_received"]
    assert got["fetched_shm"] + got["fetched_tcp"] + got["viewed_shm"] == 0, got
    # the hand-written config's body limit is enforced (413 with the OpenAI error body)
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    deploy_util.assert_no_leaks(setup["dep"])


def test_worker_restarted_with_other_settings_is_rechecked(setup):
    """The refused worker is restarted on the same port with the deployment's block size: the
    router accepts it without a restart of its own; then restarted again with block size 32:
    refused again (the check runs whenever a worker comes back)."""
    url, tmp, dep = setup["url"], setup["tmp"], setup["dep"]
    port, eport = setup["ports"]["pbad"]
    setup["procs"][0].stop()
    _wait(lambda: httpx.get(url + "/cpd/workers", timeout=5).json()["pbad"]["healthy"] is False, 30, "pbad down")
    good = _worker(dep, tmp, "pbad", "prefill", port, eport, log="pbad-ok")
    setup["procs"].append(good)
    good.wait_ready()
    w = _wait(lambda: (lambda s: s if s["state"] == "accepted" else None)(
        httpx.get(url + "/cpd/workers", timeout=5).json()["pbad"]), 60, "pbad accepted")
    assert w["reason"] is None and w["max_model_len"] == setup["max_model_len"]
    assert "pbad" not in httpx.get(url + "/health", timeout=5).json()["refused"]

    good.stop()
    bad = _worker(dep, tmp, "pbad", "prefill", port, eport, "--block-size", "32", log="pbad-again")
    setup["procs"].append(bad)
    bad.wait_ready()
    w = _wait(lambda: (lambda s: s if s["state"] == "refused" else None)(
        httpx.get(url + "/cpd/workers", timeout=5).json()["pbad"]), 60, "pbad refused again")
    assert "block_size=32" in w["reason"]
    model = dep.model_name
    for i in range(4):
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": deploy_util.random_prompt(800 + i, 40),
                                                      "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(url + "/cpd/requests", timeout=5).json()[r.json()["id"]]["prefill_worker"] != "pbad"
    deploy_util.assert_no_leaks(dep)
