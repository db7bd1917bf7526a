"""``--batch-invariant`` live on paths the first live test (``test_batch_invariant_live.py``, cpd,
shm handoff) does not take: ``pd`` topology with the handoff forced over TCP, L3 write-through to
a real Redis, a step budget of 40 tokens, prompts at the attention's key-block edges (127 / 128 /
129 / 255 / 257 tokens, one token), warm follow-ups whose cached prefix (the prefill worker's L1)
ends inside a key block, and sampling that is not plain greedy (seeded temperature sampling,
penalties). Every answer must be the tokens of one batch-invariant bfloat16 engine running the
prompt alone, with the same sampling. With the mode off (workers and oracle) 1 of the 22 answers
differed (a warm 257-token prompt, greedy, at its 5th token)."""
from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from cpd.engine.engine import Engine
from cpd.engine.sampling import SamplingParams
from deploy_util import (assert_no_leaks, complete, random_prompt, routing_record, staggered_requests, start,
                         stream_completion)

MAX_TOKENS = 24
SAMPLINGS = {"greedy": {}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 77},
             "penalties": {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.3}}


@pytest.fixture(scope="module")
def pd_dep(tiny_model_dir, module_redis):
    dep = start(tiny_model_dir, "pd", kv_store=module_redis.url, handoff_force_tcp=True, max_num_batched_tokens=40,
                settings={"engine.dtype": "bfloat16", "engine.batch_invariant": True})
    yield dep
    dep.stop()


def _oracle(model_dir: str, prompt: list[int], extra: dict, max_tokens: int = MAX_TOKENS) -> list[int]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=extra.get("temperature", 0.0), ignore_eos=True,
                        **{k: v for k, v in extra.items() if k != "temperature"})
    return Engine(model_dir, num_blocks=64, dtype=torch.bfloat16, batch_invariant=True).generate(prompt, sp)


def _storm(dep, prompts: dict[str, tuple[list[int], dict]], cached: dict[str, int]) -> dict[str, list[int] | str]:
    """Send every prompt at once; their tokens (or the error's text). ``cached``: filled with each
    answer's cached prompt tokens."""
    keys = list(prompts)

    def send(i: int) -> list[int]:
        prompt, extra = prompts[keys[i]]
        r = complete(dep, prompt, MAX_TOKENS, **extra)
        rec = routing_record(dep, r["id"])
        assert rec["decode_worker"] and rec["decode_worker"] != rec["prefill_worker"], rec  # a handoff
        cached[keys[i]] = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        return r["choices"][0]["token_ids"]
    done = staggered_requests(send, list(range(len(keys))), stagger_s=0.0, join_s=300.0)
    return {keys[i]: tokens for i, (_, tokens) in done.items()}


def test_pd_tcp_handoff_l3_edges_and_sampling_get_the_lone_oracle_tokens(pd_dep):
    lengths = (1, 127, 128, 129, 255, 257)
    cold = {f"c{n}-{s}": (random_prompt(6000 + n, n), SAMPLINGS[s])
            for n in lengths for s in ("greedy", "seeded", "penalties") if n != 1 or s == "greedy"}
    cold = {k: (p if k.endswith("greedy") else p[:-1] + [p[-1] + 1], x) for k, (p, x) in cold.items()}  # distinct prompts
    cached: dict[str, int] = {}
    got = _storm(pd_dep, cold, cached)
    warm = {f"w{n}-{s}": (random_prompt(6000 + n, n)[:n - 5] + random_prompt(7000 + n + 500 * i, 30), SAMPLINGS[s])
            for n in (129, 255, 257) for i, s in enumerate(("greedy", "seeded"))}
    got.update(_storm(pd_dep, warm, cached))
    # the warm prompts reuse the cold ones' full blocks: a prefix that ends inside a 128-key block
    assert {k: cached.get(k) for k in warm} == {k: (int(k[1:4]) - 5) // 16 * 16 for k in warm}, cached
    wrong = {}
    for k, (p, extra) in {**cold, **warm}.items():
        want = _oracle(pd_dep.model_dir, p, extra)
        if got.get(k) != want:
            v = got.get(k)
            wrong[k] = v if not isinstance(v, list) else next((i for i, (a, b) in enumerate(zip(v, want)) if a != b), len(v))
    assert not wrong, f"answers off the oracle (first differing index or error): {wrong}"
    assert_no_leaks(pd_dep)


@pytest.fixture
def migrate_dep(tiny_model_dir):
    dep = start(tiny_model_dir, "pd", num_prefill=1, num_decode=2, max_num_batched_tokens=40,
                settings={"engine.dtype": "bfloat16", "engine.batch_invariant": True},
                extra_env={"CPD_DISPATCH_TIMEOUTS": json.dumps({"max_decode_migrations": 2, "decode_idle_s": 3.0})})
    yield dep
    dep.stop()


def test_decode_migrated_mid_stream_ends_on_the_oracle_tokens(migrate_dep):
    """The decode worker SIGKILLed after 10 streamed tokens: the prompt and the tokens so far are
    re-prefilled (in 40-token steps) and decoding goes on on the other decode worker; the stream
    ends with the text of the uninterrupted answer, whose tokens are the lone oracle's."""
    dep = migrate_dep
    prompt, max_tokens = random_prompt(6500, 257), 300
    out: dict = {}
    t = threading.Thread(target=stream_completion, args=(dep, prompt, max_tokens, out), daemon=True)
    t.start()
    deadline = time.time() + 60
    while len(out.get("chunks", [])) < 10 and time.time() < deadline:
        time.sleep(0.005)
    first = routing_record(dep, out["id"])["decode_worker"]
    dep.kill_worker(first)
    t.join(120)
    assert not t.is_alive() and out["error"] is None and out["finish"] == "length", (out["error"], out["finish"])
    rec = routing_record(dep, out["id"])
    assert rec["decode_worker"] != first and len(rec["decode_failures"]) == 1, rec
    whole = complete(dep, prompt, max_tokens)["choices"][0]
    assert whole["token_ids"] == _oracle(dep.model_dir, prompt, {}, max_tokens)
    assert "".join(out["chunks"]) == whole["text"]
    assert_no_leaks(dep)
