"""Issue 7 §9 against a live tiny-model deployment: schema-driven fuzzing of the router's
OpenAPI document (schemathesis, valid and invalid bodies) finds no 5xx and every error has the
OpenAI error body; client cancels count as ``outcome="cancelled"``, not ``error``."""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

import deploy_util

FUZZ_BUDGET_S = 60.0
MAX_EXAMPLES = {"POST": 30, "GET": 4}  # per operation and generation mode


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = deploy_util.start(tiny_model_dir, num_blocks=16)  # max_model_len 256: generated requests stay short
    yield d
    d.stop()


def _error_body_ok(resp) -> bool:
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)


def test_schema_fuzz_no_server_errors(dep):
    schema = schemathesis.openapi.from_url(f"{dep.url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions"} <= {op.path for op in ops}
    problems: list[str] = []
    statuses: dict[int, int] = {}
    t0 = time.monotonic()
    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=MAX_EXAMPLES.get(op.method.upper(), 4), deadline=None, database=None,
                      derandomize=True, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                resp = case.call(base_url=dep.url, timeout=60)
                statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
                where = f"{case.method} {case.formatted_path} body={str(case.body)[:300]!r}"
                if resp.status_code >= 500:
                    problems.append(f"{resp.status_code} for {where}: {resp.text[:300]}")
                elif resp.status_code >= 400 and not _error_body_ok(resp):
                    problems.append(f"{resp.status_code} without the OpenAI error body for {where}: {resp.text[:200]}")
            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
                assert mode == GenerationMode.NEGATIVE, op.path
    elapsed = time.monotonic() - t0
    print(f"fuzz: {len(ops)} operations, HTTP statuses {sorted(statuses.items())}, {elapsed:.1f} s")
    assert not problems, "\n".join(problems[:20])
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0, statuses
    assert elapsed < FUZZ_BUDGET_S * 2, f"fuzzing took {elapsed:.0f} s"
    deploy_util.assert_no_leaks(dep)


def _outcomes(dep) -> dict[str, float]:
    text = httpx.get(f"{dep.url}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^cpd_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_client_cancels_count_as_cancelled_not_error(dep):
    """The decode worker is stopped (SIGSTOP) so that both requests are still running when their
    clients hang up (the tiny model would otherwise finish 200 tokens before the hang-up lands)."""
    before = _outcomes(dep)
    body = {"model": dep.model_name, "prompt": deploy_util.random_prompt(5, 20), "max_tokens": 200,
            "temperature": 0, "ignore_eos": True}
    decode_pid = dep.pids()["d0"]
    os.kill(decode_pid, signal.SIGSTOP)
    try:
        # non-streaming: the client gives up while the request waits for decode
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{dep.url}/v1/completions", json=body, timeout=httpx.Timeout(1.0, connect=5))
        # streaming: hang up after the first event (the first token, from the prefill side)
        with httpx.stream("POST", f"{dep.url}/v1/completions", json=dict(body, stream=True), timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        deadline = time.monotonic() + 20
        after = _outcomes(dep)
        while after.get("cancelled", 0) < before.get("cancelled", 0) + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            after = _outcomes(dep)
    finally:
        os.kill(decode_pid, signal.SIGCONT)
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 2, (before, after)
    assert after.get("error", 0) == before.get("error", 0), (before, after)
    assert after.get("ok", 0) == before.get("ok", 0), (before, after)
    deploy_util.assert_no_leaks(dep)


def test_stop_string_match_counts_as_ok_not_cancelled(dep):
    """The front closes the backend generator once a stop string matched: that ends a finished
    request (outcome ok), not a cancelled one (non-streaming and streaming)."""
    body = {"model": dep.model_name, "prompt": deploy_util.random_prompt(6, 20), "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    text = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    mid = text.strip()[len(text.strip()) // 2:][:3]
    assert mid, f"the model produced no text to stop on: {text!r}"
    before = _outcomes(dep)
    r = httpx.post(f"{dep.url}/v1/completions", json=dict(body, stop=[mid]), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    with httpx.stream("POST", f"{dep.url}/v1/completions", json=dict(body, stop=[mid], stream=True), timeout=60) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"finish_reason":"stop"' in events[-2].replace(" ", "")
    deadline = time.monotonic() + 10
    after = _outcomes(dep)
    while after.get("ok", 0) < before.get("ok", 0) + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        after = _outcomes(dep)
    assert after.get("ok", 0) == before.get("ok", 0) + 2, (before, after)
    assert after.get("cancelled", 0) == before.get("cancelled", 0), (before, after)
    deploy_util.assert_no_leaks(dep)
