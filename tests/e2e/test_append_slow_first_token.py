"""A decode-local append whose first token comes later than the router's estimate allows is
rerouted, and its decode worker is not blamed for it.

The router bounds an append's first token by its estimate (``prefill_floor_s + prefill_slack x
estimate``): an append is short by construction, and one that misses is rerouted through the
prefill pool. The miss used to count as a *failed worker*: the decode worker, whose heartbeats and
engine were fine, was marked unhealthy and excluded for the request, so the rerouted request found
no decode worker (503 with one) and others were refused until the next good poll. An estimate may
steer routing; it must not fail a worker that makes progress.

Real router, worker processes and HTTP (tiny torch model, float32, adaptive ``cpd`` 1 + 1 + 1 with
decode-local appends on). The slow first token is the one fake: ``CPD_FAULT_STEP_HANG_SEED`` in
the decode worker only holds the seeded append's prefill step for ``HANG_S`` (far below
``engine.max_step_s``: not stuck).
"""
from __future__ import annotations

import json
import time

from deploy_util import assert_no_leaks, complete, oracle_tokens, random_prompt, router_workers, routing_record, start

HANG_SEED, HANG_S = 4545, 6.0
TIMEOUTS = {"prefill_floor_s": 1.0, "prefill_slack": 1.0}  # an append's first token is due within ~1 s


def test_an_append_slower_than_its_estimate_is_rerouted_and_its_worker_stays_healthy(tiny_model_dir):
    dep = start(tiny_model_dir, "cpd",
                settings={"engine.dtype": "float32", "router.routing_mode": "adaptive", "router.tpot_slo_s": 0.5,
                          "router.decode_append_max_tokens": 64},
                extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps(TIMEOUTS), "CPD_FAULT_WORKER": "d0",
                           "CPD_FAULT_STEP_HANG_SEED": str(HANG_SEED), "CPD_FAULT_STEP_HANG_S": str(HANG_S)})
    try:
        turn1 = random_prompt(61, 90)
        r1 = complete(dep, turn1, 12)
        assert routing_record(dep, r1["id"])["decode_worker"] == "d0"
        dep.wait_indexed(turn1 + r1["choices"][0]["token_ids"], "L1", worker_id="d0")  # d0's BlockStored events
        turn2 = turn1 + r1["choices"][0]["token_ids"] + random_prompt(62, 8)
        t0 = time.monotonic()
        r2 = complete(dep, turn2, 1, seed=HANG_SEED)  # before: 503, no healthy decode worker
        waited_s = time.monotonic() - t0
        rec = routing_record(dep, r2["id"])
        assert rec["prefill_worker"] != "d0", rec  # rerouted through the prefill pool
        assert r2["choices"][0]["token_ids"] == oracle_tokens(tiny_model_dir, turn2, 1, dtype="float32")
        assert waited_s < HANG_S, waited_s  # it did not wait for the slow step
        assert router_workers(dep)["d0"]["healthy"]
        r3 = complete(dep, random_prompt(63, 30), 4)  # d0 still decodes
        assert routing_record(dep, r3["id"])["decode_worker"] == "d0"
        time.sleep(HANG_S)  # the abandoned append's step ends; it is aborted
        assert_no_leaks(dep)
    finally:
        dep.stop()
