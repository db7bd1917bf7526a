"""Adversarial session 17 (helper): failure classes the earlier adversarial files do not use.

Findings:

- ``cpd bench`` against a server it cannot use (nothing listening, a 404 / non-JSON
  ``/v1/models``, a key it refuses) ended in a 270-line rich traceback of httpx internals, and it
  asked the server before reading the trace, so a malformed trace with no server up was reported
  as ``ConnectError``. ``cpd bench compare`` on a truncated or foreign results file (bad JSON, a
  list, a summary without the figures it prints) ended in a ``JSONDecodeError`` / ``KeyError``
  traceback. ``cpd analyze`` and ``cpd simulate`` already said "file:line: expected ...; got ...".
  Now the trace is read first and each of these is a one-paragraph usage error (exit 2) naming the
  URL or the file and what was wrong. ``--special-ids a,b`` ended in a ``ValueError`` traceback,
  and ``--timeout-s 0`` (every request failed) and ``--warm-threshold 5`` were accepted; they are
  usage errors now.
- Chat options of OpenAI's own API that change the answer were silently ignored (session 16 closed
  this for vLLM's extensions): ``modalities: ["audio"]`` / ``["text", "audio"]`` and ``audio:
  {"voice", "format"}`` (an audio answer asked for) and ``web_search_options`` (the answer is to use
  a web search) got 200 with a plain text answer, through the official ``openai`` client too. They
  are now 400s naming the field unless neutral (``modalities: ["text"]``, null).

- Registration (``POST /cpd/register``, signed with the internal secret: a misconfigured or
  copy-pasted ``cpd worker`` command line, not an outsider) trusted the registration over the
  worker answering at its address. (a) A second live process started with a known worker's id at
  another address (``cpd worker --worker-id p0 ...`` twice) moved ``p0`` to it, and the first
  process's periodic re-registration moved it back: live, ``p0`` flapped 29 times in 60 s between
  the two processes, each move dropping its index entries; with ``--role decode`` the second one
  turned the prefill worker ``p0`` into a decode worker every other time. (b) A registration of a
  known prefill worker as ``decode`` at its own address changed its role before checking it, the
  check then refused it: one bad registration took a healthy worker out of routing. (c) A
  registration naming another worker's address was accepted: ``p1`` at ``p0``'s address made one
  process two workers, and ``d0`` (decode) at ``p0``'s address took the only decode worker out
  (every request 503). Now the router checks before it changes anything: the worker answering at
  the address must report the registered id; a known worker moves to another address or kind of
  role only once the new address passes the compatibility check and while its old address does not
  still answer as that id with another boot id (409 ``duplicate_worker_id``, naming the live one).
- ``POST /cpd/role`` on a worker started with ``--router`` answered ``"result": "already
  pre-prefill"`` for a change it had just made (4 of 5 changes live): the worker re-registers with
  its new role as soon as it changes, and that registration reached the router's view before the
  role endpoint's own update (recorded with the registration's reason, not "forced via POST
  /cpd/role"). The result now comes from the worker's answer (``from_role`` vs ``to_role``).

- ``cpd serve`` / ``cpd worker`` with settings a worker cannot start with ended in tracebacks: an
  L3 URL no store opens (``--kv-store bogus://x``, a bare path) passed the configuration check and
  failed in every worker at start-up (``ValueError: unknown store URL scheme`` in a
  ``DeploymentError`` rich traceback); ``--dtype float16`` on a CPU and a model directory with no
  weights likewise. The URL's scheme is now checked with the configuration (exit 2, the key and
  the known schemes); a worker that cannot run the dtype or find the model exits with one line, and
  ``cpd serve`` prints the worker's reason and exits 1.
- A ``cpd worker`` whose ``--port`` or ``--events-port`` (default ``--port`` + 1) another process
  holds ended in a ``ZMQError`` / ``OSError`` traceback, the HTTP one only after loading the
  model. Both ports are now bound first, with one line naming the address.
- ``cpd router --served-from URL`` whose worker does not answer waited up to 300 s without a word
  (it looked hung); it now logs once per worker what it waits for and for how long at most.

- ``cpd simulate`` with an unknown experiment name, an experiment file that is not JSON, ``--qps
  -1`` or an ``--out`` it cannot create ended in tracebacks (FileNotFoundError / JSONDecodeError /
  ValueError); each is now one line (exit 2) naming what was wrong.

- Wrong tokens: a worker restarted at the same id and address with other weights (a rolling model
  upgrade done by restarting workers one by one, or a wrong ``--model``) was sent requests until
  the router's poller saw its new boot id (``/load``, every 0.5 s) and rechecked its ``/info``:
  live, 4 closed-loop clients, ``p0`` SIGKILLed and restarted on a tiny model of another seed: 1
  wrong answer (of 1,155) in that window, then ``p0`` was refused ("KV namespace differs"); with
  the router paused across the restart (the test below) every time. Requests carried nothing the
  worker could check. Now the router sends the boot id it checked (``expect_boot_id``) with every
  prefill, decode and append call; another process answers 409 ``worker_restarted``, which the
  router handles like a stuck engine (retry elsewhere; the poller rechecks the worker).

What held (probes against a hand-started ``cpd router`` + three ``cpd worker --router`` processes,
float32, Redis L3, two API keys; no test needed beyond this file; notes in
/work/notes/adversarial17.md):

- L3 content changed by a third party under the real keys while 4 closed-loop clients ran and every
  worker's L1/L2 was reset each second (1,600 changes in 35 s: random bytes, a flipped byte,
  truncation, values swapped between keys, 64 zero bytes appended, emptied, header bytes
  overwritten): 808 answers all exact, 0 errors, 147 reads counted as ``corrupt`` and recomputed.
- Redis full (``maxmemory`` 1.7 MB, ``noeviction``): write-throughs refused, 760 answers exact.
- 400 concurrent requests (60 % streamed) of which 70 % hang up after 0.02-2 s: 70 got 429
  (``max_in_flight``), every patient one exact, ``/metrics`` answered in 0.16 s during the storm,
  pools, stagings and in-flight counts back to 0.
- SIGKILL of the prefill worker under load, restarted with the same id and port: no request
  failed; SIGKILL of the only decode worker: in-flight streams ended with an error naming it,
  new requests got an immediate 503 until it re-registered (~4 s), stagings back to 0.
- Tenants: tenant B sending tenant A's prompt + A's output + a suffix got 0 cached tokens, A got
  its prefix, a ``cache_salt`` got 0; same text (3 of 3).
- Auth: every router path without a key, with a wrong key or a Basic header is 401 (``/health``
  and ``/metrics`` open; no tenant label in metrics); ``POST /cpd/role`` and ``/cpd/register``
  need the signature (401 / 403); 11 malformed signed role bodies get 400 / 404 / 409 bodies.
- The official ``openai`` client: models list / retrieve / unknown model 404, ``max_completion_tokens``
  = ``max_tokens``, seeded sampling equal plain and streamed, stop strings, usage in streams,
  ``n=2`` / ``top_logprobs`` / ``response_format json`` / ``tool`` messages refused with 400.
- Configuration: 14 wrong ``--set`` values (types, ranges, unknown keys and sections, conflicting
  topology / pool sizes / ``--elastic``) and malformed TOML / YAML / JSON files: one clear line each.
- ``cpd analyze`` / ``cpd simulate`` / ``cpd bench`` on 24 malformed traces (truncated JSONL line,
  wrong types, negative / 1e12 lengths, NaN / 1e400 timestamps, float hash ids, decreasing
  timestamps, empty / blank / binary files, CSV with a bad row or a missing column, truncated gzip,
  a Claude Code folder with a bad or no conversation, a missing path): "file:line: expected ...;
  got ...", exit 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from cpd.auth import SignedAuth
from cpd.deploy import free_port
from deploy_util import complete, oracle_tokens, random_prompt, start

SECRET = "adversarial-s17-secret"

CPD = [sys.executable, "-m", "cpd.cli"]


def _cpd(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*CPD, *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200", "TERM": "dumb"})


def _serve(*args: str) -> subprocess.CompletedProcess:
    return _cpd("serve", "--port", str(_free_port()), "--topology", "pd", "--prefill", "1", *args, timeout_s=120)


def test_serve_with_a_store_url_no_store_opens_is_a_configuration_error(tiny_model_dir):
    r = _serve("--model", tiny_model_dir, "--kv-store", "bogus://x")
    _assert_clear_usage_error(r, "kv.l3_url", "redis://")


def test_serve_with_a_worker_that_cannot_start_says_why_in_one_line(tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("float16 runs on CUDA")
    for args, why in [(("--model", tiny_model_dir, "--dtype", "float16"), "float16 is supported on CUDA only"),
                      (("--model", "/nonexistent-model-dir"), "no *.safetensors in /nonexistent-model-dir")]:
        r = _serve(*args)
        out = r.stdout + r.stderr
        assert r.returncode == 1 and "Traceback" not in out and why in out, out[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_clear_usage_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    for n in needles:
        assert n in out, (n, out[-2000:])


GOOD_ROW = {"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [0]}


def test_bench_reads_the_trace_before_asking_the_server(tmp_path: Path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD_ROW) + "\n" + '{"timestamp": 0,')
    r = _cpd("bench", "--url", f"http://127.0.0.1:{_free_port()}", "--trace", str(trace))
    _assert_clear_usage_error(r, "t.jsonl:2")


@pytest.mark.parametrize("server", ["nothing_listening", "not_found"])
def test_bench_against_a_server_it_cannot_use_is_a_clear_error(tmp_path: Path, server: str):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD_ROW) + "\n")
    port = _free_port()
    proc = None
    if server == "not_found":  # answers every path with a 404 HTML page
        (tmp_path / "empty").mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                 "--directory", str(tmp_path / "empty")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(port)
    try:
        r = _cpd("bench", "--url", f"http://127.0.0.1:{port}", "--trace", str(trace))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    _assert_clear_usage_error(r, "--url", f"127.0.0.1:{port}/v1/models")


def _wait_listening(port: int, timeout_s: float = 10.0) -> None:
    import socket
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listening on {port}")


@pytest.mark.parametrize("content", ['{"summary": {"ok": 1', "[]", '{"summary": {"ok": 1}}',
                                     '{"summary": [], "records": []}'])
def test_bench_compare_on_a_file_that_is_not_a_results_file_is_a_clear_error(tmp_path: Path, content: str):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = _cpd("bench", "compare", str(bad))
    _assert_clear_usage_error(r, "bad.json", "not a cpd bench results file")


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, internal_secret=SECRET)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(dep):
    with openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field,value", [("modalities", ["audio"]), ("modalities", ["text", "audio"]),
                                         ("audio", {"voice": "alloy", "format": "wav"}),
                                         ("web_search_options", {}),
                                         ("web_search_options", {"search_context_size": "high"})])
def test_openai_output_options_the_server_does_not_give_are_refused(dep, client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=dep.model_name, messages=CHAT, max_tokens=2,
                                       extra_body={field: value})
    assert e.value.status_code == 400
    assert field in str(e.value.body)


@pytest.mark.parametrize("field,value", [("modalities", ["text"]), ("audio", None), ("web_search_options", None)])
def test_their_neutral_values_are_served(dep, client, field, value):
    r = client.chat.completions.create(model=dep.model_name, messages=CHAT, max_tokens=2, extra_body={field: value})
    assert r.usage.completion_tokens == 2


def _workers(dep) -> dict:
    return httpx.get(f"{dep.url}/cpd/workers", timeout=10).json()


def _register(dep, **reg) -> httpx.Response:
    return httpx.post(f"{dep.url}/cpd/register", auth=SignedAuth(SECRET.encode()), json=reg, timeout=30)


def _events(dep, worker_id: str) -> str:
    return next(w["events_endpoint"] for w in dep.workers if w["worker_id"] == worker_id)


def _assert_in_place_and_serving(dep, before: dict) -> None:
    after = _workers(dep)
    assert set(after) == set(before), after
    for wid, b in before.items():
        a = after[wid]
        assert (a["url"], a["role"], a["state"], a["healthy"]) == (b["url"], b["role"], "accepted", True), (wid, a)
    prompt = random_prompt(17, 40)
    assert complete(dep, prompt, 6)["choices"][0]["token_ids"] == oracle_tokens(dep.model_dir, prompt, 6)


@pytest.mark.parametrize("worker_id,role", [("p1", "prefill"), ("d0", "prefill")])
def test_a_registration_naming_another_workers_address_is_refused(dep, worker_id, role):
    before = _workers(dep)
    p0 = before["p0"]["url"]
    r = _register(dep, worker_id=worker_id, role=role, url=p0, events_endpoint=_events(dep, "p0"))
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_refused", r.text
    assert "'p0'" in r.json()["error"]["message"]
    _assert_in_place_and_serving(dep, before)


def test_a_known_worker_registering_as_another_kind_of_role_is_refused_and_left_in_place(dep):
    before = _workers(dep)
    r = _register(dep, worker_id="p0", role="decode", url=before["p0"]["url"], events_endpoint=_events(dep, "p0"))
    assert r.status_code == 409, r.text
    _assert_in_place_and_serving(dep, before)


def test_a_second_live_process_with_a_known_worker_id_is_refused(dep, tmp_path):
    """A real second ``cpd worker --worker-id p0`` (as decode) beside the live ``p0``: its own
    registrations and one signed here are refused with ``duplicate_worker_id``; ``p0`` stays."""
    before = _workers(dep)
    log_path = tmp_path / "twin.log"
    twin, port, events_port = _spawn_worker(dep, "decode", "p0", log_path)
    try:
        deadline = time.monotonic() + 60
        while "duplicate_worker_id" not in log_path.read_text() and "worker_refused" not in log_path.read_text():
            assert twin.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        r = _register(dep, worker_id="p0", role="decode", url=f"http://127.0.0.1:{port}",
                      events_endpoint=f"tcp://127.0.0.1:{events_port}")
        assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_worker_id", r.text
        assert before["p0"]["url"] in r.json()["error"]["message"]
        _assert_in_place_and_serving(dep, before)
    finally:
        twin.terminate()
        twin.wait(30)


def _spawn_worker(dep, role: str, worker_id: str, log_path: Path) -> tuple[subprocess.Popen, int, int]:
    """A ``cpd worker --router`` process joining ``dep`` (as a worker on another host would)."""
    port, events_port = free_port(), free_port()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "cpd.worker.main", "--role", role, "--worker-id", worker_id,
                                 "--host", "127.0.0.1", "--port", str(port), "--events-port", str(events_port),
                                 "--config", str(dep.worker_config_path), "--torch-threads", "1",
                                 "--router", dep.url],
                                stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "CPD_INTERNAL_SECRET": SECRET})
    return proc, port, events_port


def _change_role(dep, worker_id: str, role: str) -> dict:
    r = httpx.post(f"{dep.url}/cpd/role", auth=SignedAuth(SECRET.encode()), timeout=30,
                   json={"worker_id": worker_id, "role": role})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_role_change_of_a_registered_worker_is_reported_as_a_change(dep, tmp_path):
    """Runs last: the joined worker leaves the module deployment with one worker it no longer has.
    A worker started with ``--router`` re-registers with its new role as soon as it changes, and
    that registration reached the router's view before ``POST /cpd/role``'s own update: the
    answer said ``already pre-prefill`` for a change it had just made (4 of 5 changes live)."""
    proc, _, _ = _spawn_worker(dep, "prefill", "p9", tmp_path / "p9.log")
    try:
        deadline = time.monotonic() + 60
        while _workers(dep).get("p9", {}).get("state") != "accepted":
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "p9.log").read_text()[-3000:]
            time.sleep(0.2)
        for role in ["pre-prefill", "prefill", "pre-prefill", "prefill"]:
            assert _change_role(dep, "p9", role) == {"worker_id": "p9", "role": role, "result": "changed"}
        assert _change_role(dep, "p9", "prefill")["result"] == "already prefill"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("taken", ["port", "events_port"])
def test_a_worker_whose_port_is_taken_says_so_in_one_line(dep, tiny_model_dir, taken):
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = holder.getsockname()[1]
        ports = {"port": free_port(), "events_port": free_port(), taken: busy}
        r = subprocess.run([sys.executable, "-m", "cpd.worker.main", "--role", "prefill", "--worker-id", "p8",
                            "--host", "127.0.0.1", "--port", str(ports["port"]),
                            "--events-port", str(ports["events_port"]),
                            "--config", str(dep.worker_config_path), "--torch-threads", "1"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CPD_INTERNAL_SECRET": SECRET})
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert f"127.0.0.1:{busy}" in out and "Address already in use" in out, out[-3000:]


def test_a_router_waiting_for_its_served_from_worker_says_so(tmp_path):
    config = tmp_path / "router.toml"
    config.write_text("")
    proc = subprocess.Popen([*CPD, "router", "--config", str(config), "--host", "127.0.0.1",
                             "--port", str(_free_port()), "--served-from", f"http://127.0.0.1:{_free_port()}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import select

    try:  # the router waits up to 300 s for the worker: its first line must come long before
        ready, _, _ = select.select([proc.stdout], [], [], 30.0)
        line = proc.stdout.readline() if ready else ""
    finally:
        proc.kill()
        proc.wait(10)
    assert "waiting for http://127.0.0.1:" in line and "GET /info" in line, line


@pytest.mark.parametrize("option,value", [("--special-ids", "a,b"), ("--timeout-s", "0"), ("--warm-threshold", "5")])
def test_bench_options_out_of_range_are_usage_errors(dep, tmp_path: Path, option: str, value: str):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD_ROW) + "\n")
    r = _cpd("bench", "--url", dep.url, "--trace", str(trace), "--quiet", option, value)
    _assert_clear_usage_error(r, option)


@pytest.mark.parametrize("case", ["unknown_experiment", "not_json", "negative_qps", "unwritable_out"])
def test_simulate_with_arguments_it_cannot_use_is_a_clear_error(tmp_path: Path, case: str):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD_ROW) + "\n")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",')
    args, needle = {"unknown_experiment": (["no_such_experiment"], "no_such_experiment"),
                    "not_json": ([str(bad)], "bad.json"),
                    "negative_qps": (["--trace", str(trace), "--qps", "-1"], "--qps"),
                    "unwritable_out": (["--trace", str(trace), "--out", "/proc/no/such"], "/proc/no/such")}[case]
    _assert_clear_usage_error(_cpd("simulate", *args), needle)


def test_a_worker_restarted_with_other_weights_never_answers_before_it_is_rechecked(tiny_model_dir, tmp_path):
    import signal

    from cpd.engine.weights import make_tiny_llama_dir

    other = str(make_tiny_llama_dir(tmp_path / "tiny-other", seed=1))
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, internal_secret=SECRET,
              settings={"engine.dtype": "float32"})
    twin = None
    try:
        prompt = random_prompt(23, 40)
        want = oracle_tokens(d.model_dir, prompt, 6, dtype="float32")
        assert complete(d, prompt, 6)["choices"][0]["token_ids"] == want
        p0 = next(w for w in d.workers if w["worker_id"] == "p0")
        port, events_port = int(p0["url"].rsplit(":", 1)[1]), int(p0["events_endpoint"].rsplit(":", 1)[1])
        d.kill_worker("p0")
        router_pid = d.pids()["router"]
        os.kill(router_pid, signal.SIGSTOP)  # no poll sees the restart before a request reaches it
        try:
            twin = subprocess.Popen([sys.executable, "-m", "cpd.worker.main", "--role", "prefill", "--worker-id", "p0",
                                     "--host", "127.0.0.1", "--port", str(port), "--events-port", str(events_port),
                                     "--config", str(d.worker_config_path), "--model", other,
                                     "--torch-threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env={**os.environ, "CPD_INTERNAL_SECRET": SECRET})
            deadline = time.monotonic() + 60
            while not (_listening(port) and httpx.get(f"{p0['url']}/health", timeout=5).status_code == 200):
                assert twin.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            import threading

            body = {"model": d.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            answer: dict = {}
            sender = threading.Thread(target=lambda: answer.update(
                r=httpx.post(f"{d.url}/v1/completions", json=body, timeout=60)))
            sender.start()
            time.sleep(0.5)  # the request waits in the paused router's accept queue
        finally:
            os.kill(router_pid, signal.SIGCONT)
        sender.join(60)
        r = answer["r"]
        # the only prefill worker now serves other weights: a clear error, never other tokens
        if r.status_code == 200:
            assert r.json()["choices"][0]["token_ids"] == want, r.text[:300]
        else:
            assert r.status_code >= 500 and "error" in r.json(), r.text[:300]
        deadline = time.monotonic() + 30
        while _workers(d)["p0"]["state"] != "refused":  # the poller's recheck: another KV namespace
            assert time.monotonic() < deadline, _workers(d)["p0"]
            time.sleep(0.2)
    finally:
        if twin is not None:
            twin.kill()
            twin.wait(30)
        d.stop()


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
