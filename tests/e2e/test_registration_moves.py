"""A known worker registering at a new address is moved only once that address passes the
compatibility check (real router and workers, signed registrations with the deployment's
internal secret). A registration whose address does not answer, or answers as an incompatible
worker, is refused with 409 and leaves the known worker where it was, routed to as before (it
used to be moved first and checked after: one bad registration took a healthy worker out)."""
from __future__ import annotations

import httpx
import pytest

from cpd.auth import SignedAuth
from deploy_util import complete, oracle_tokens, random_prompt, start

SECRET = "registration-moves-secret"


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = start(tiny_model_dir, "pd", num_prefill=1, num_decode=1, internal_secret=SECRET)
    yield d
    d.stop()


def _workers(dep) -> dict:
    return httpx.get(f"{dep.url}/cpd/workers", timeout=10).json()


@pytest.mark.parametrize("where", ["nobody listens", "the prefill worker answers"])
def test_a_registration_at_a_bad_address_leaves_the_known_worker_in_place(dep, where):
    before = _workers(dep)["d0"]
    assert before["state"] == "accepted", before
    url = "http://127.0.0.1:9" if where == "nobody listens" else _workers(dep)["p0"]["url"]
    r = httpx.post(f"{dep.url}/cpd/register", auth=SignedAuth(SECRET.encode()), timeout=30,
                   json={"worker_id": "d0", "role": "decode", "url": url, "events_endpoint": "tcp://127.0.0.1:9"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "worker_refused", r.text
    after = _workers(dep)["d0"]
    assert (after["url"], after["state"], after["healthy"]) == (before["url"], "accepted", True), after
    prompt = random_prompt(77, 40)
    assert complete(dep, prompt, 6)["choices"][0]["token_ids"] == oracle_tokens(dep.model_dir, prompt, 6)
