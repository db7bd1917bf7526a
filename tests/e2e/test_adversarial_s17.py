"""Adversarial session 17 (helper): failure classes the earlier adversarial files do not use.

Findings:

- ``cpd bench`` against a server it cannot use (nothing listening, a 404 / non-JSON
  ``/v1/models``, a key it refuses) ended in a 270-line rich traceback of httpx internals, and it
  asked the server before reading the trace, so a malformed trace with no server up was reported
  as ``ConnectError``. ``cpd bench compare`` on a truncated or foreign results file (bad JSON, a
  list, a summary without the figures it prints) ended in a ``JSONDecodeError`` / ``KeyError``
  traceback. ``cpd analyze`` and ``cpd simulate`` already said "file:line: expected ...; got ...".
  Now the trace is read first and each of these is a one-paragraph usage error (exit 2) naming the
  URL or the file and what was wrong.
- Chat options of OpenAI's own API that change the answer were silently ignored (session 16 closed
  this for vLLM's extensions): ``modalities: ["audio"]`` / ``["text", "audio"]`` and ``audio:
  {"voice", "format"}`` (an audio answer asked for) and ``web_search_options`` (the answer is to use
  a web search) got 200 with a plain text answer, through the official ``openai`` client too. They
  are now 400s naming the field unless neutral (``modalities: ["text"]``, null).

What held (probes, no test needed beyond this file): ``cpd analyze`` / ``cpd simulate`` / ``cpd
bench`` on 24 malformed traces (truncated JSONL line, wrong types, negative / 1e12 lengths, NaN /
1e400 timestamps, float hash ids, decreasing timestamps, empty / blank / binary files, CSV with a
bad row or a missing column, truncated gzip, a Claude Code folder with a bad or no conversation, a
missing path): a clear "file:line: expected ...; got ..." error, exit 2, never a traceback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from deploy_util import start

CPD = [sys.executable, "-m", "cpd.cli"]


def _cpd(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([*CPD, *args], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200", "TERM": "dumb"})


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
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1)
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
