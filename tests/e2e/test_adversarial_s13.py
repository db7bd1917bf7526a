"""Adversarial session 13 (helper-63): inputs and faults the other e2e files do not use, against
real deployments (router + worker processes of the tiny random-weight Llama, real HTTP).

- Worker registration with client API keys on and no internal secret (a ``cpd router
  --api-key-file`` started without ``$CPD_INTERNAL_SECRET``): ``POST /cpd/register`` bypasses the
  API-key middleware (it is "self-authenticated" by the internal secret) and, with no secret,
  authenticated nothing: one unauthenticated POST moved the decode worker ``d0`` to an address of
  the caller's choosing, so every tenant's next request failed with 503 (or, with a fake worker
  behind that address, would have been sent to the caller). ``POST /cpd/role`` already refused
  this configuration with 403 ``internal_secret_required``; registration now does the same.

Findings and what held: /work/notes/adversarial13.md.
"""
from __future__ import annotations

import httpx
import pytest

from deploy_util import oracle_tokens, random_prompt, start

ALICE = "sk-alice-s13-0123456789"


@pytest.fixture(scope="module")
def keys_no_secret_dep(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("s13keys") / "keys"
    keys.write_text(f"{ALICE} alice\n")
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, api_key_files=[str(keys)])
    yield d
    d.stop()


def _workers(dep) -> dict:
    r = httpx.get(f"{dep.url}/cpd/workers", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def test_unauthenticated_registration_cannot_move_a_worker_when_api_keys_are_on(keys_no_secret_dep):
    dep = keys_no_secret_dep
    before = _workers(dep)
    assert before["d0"]["state"] == "accepted", before
    # no Authorization header, no signature: a stranger on the network
    r = httpx.post(f"{dep.url}/cpd/register", json={"worker_id": "d0", "role": "decode", "url": "http://127.0.0.1:9",
                                                     "events_endpoint": "tcp://127.0.0.1:9"}, timeout=30)
    assert r.status_code in (401, 403), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "internal_secret_required", err
    after = _workers(dep)
    assert after["d0"]["url"] == before["d0"]["url"] and after["d0"]["state"] == "accepted", after
    prompt = random_prompt(13, 24)
    out = httpx.post(f"{dep.url}/v1/completions", headers={"Authorization": f"Bearer {ALICE}"}, timeout=60,
                     json={"model": dep.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["token_ids"] == oracle_tokens(dep.model_dir, prompt, 4)
