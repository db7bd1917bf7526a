"""Issue 7 §5: KV identity follows the content.

The example that failed: a weights file rewritten with other values but the same size and
mtime (``os.utime``) kept its cached digest, so a new engine reused L3 KV computed by the
old weights (wrong tokens). The class: no digest in the namespace may survive a content
change, whatever the file's metadata says — weights, the worker's tokenizer digest and the
router's tokenizer digest.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.weights import make_tiny_llama_dir, tokenizer_digest, weights_digest
from cpd.kv.block_hash import hash_blocks
from cpd.router.tokenization import _dir_digest
from cpd.store import open_store
from cpd.store.connector import L3Connector

from deploy_util import random_prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _overwrite_keeping_metadata(target: Path, source: Path) -> None:
    """Write ``source``'s bytes into ``target`` in place (same inode), same size, then put the
    old atime/mtime back — what a careless deployment script or a backup restore does."""
    st = target.stat()
    data = source.read_bytes()
    assert len(data) == st.st_size, "the test needs same-size content"
    with open(target, "r+b") as f:
        f.write(data)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = target.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], dict]:
    engine.add_request(EngineRequest("r", prompt, GREEDY, write_through=True))
    tokens, tiers = [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            tiers = tiers or o.num_cached_tokens_by_tier
    return tokens, tiers


def test_same_size_same_mtime_new_weights_never_reuse_old_kv(tmp_path, tiny_model_dir):
    model = make_tiny_llama_dir(tmp_path / "m", seed=0, tokenizer_dir=tiny_model_dir)
    other = make_tiny_llama_dir(tmp_path / "other", seed=1, tokenizer_dir=tiny_model_dir)
    store_url = f"file://{tmp_path / 'l3'}"
    prompt = random_prompt(21, 64)

    with L3Connector(open_store(store_url), write_async=False) as conn:
        old = Engine(model, num_blocks=64, connector=conn)
        old_tokens, _ = _run(old, prompt)
        old_ns = old.namespace
        assert conn.lookup(hash_blocks(prompt, old_ns)) == 4, "the old weights' KV is in L3"
        again, tiers = _run(Engine(model, num_blocks=64, connector=conn), prompt)
        assert tiers["L3"] == 48 and again == old_tokens, "unchanged weights do reuse it"

    _overwrite_keeping_metadata(model / "model.safetensors", other / "model.safetensors")
    assert weights_digest(model) == weights_digest(other) != old_ns.weights_digest

    with L3Connector(open_store(store_url), write_async=False) as conn:
        new = Engine(model, num_blocks=64, connector=conn)
        assert new.namespace.weights_digest != old_ns.weights_digest
        new_tokens, tiers = _run(new, prompt)
    assert tiers == {"L1": 0, "L2": 0, "L3": 0}, "no block computed by the old weights is reused"
    assert new_tokens == Engine(other, num_blocks=64).generate(prompt, GREEDY)
    assert new_tokens != old_tokens


def test_tokenizer_digests_follow_content(tmp_path, tiny_model_dir):
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_model_dir) / name, d / name)
    worker_before, router_before = tokenizer_digest(d), _dir_digest(str(d))
    cfg = d / "tokenizer_config.json"
    text = cfg.read_text()
    changed = tmp_path / "changed.json"
    changed.write_text(text.replace('"', "'", 1) if text.count('"') else text[::-1])  # same length
    _overwrite_keeping_metadata(cfg, changed)
    assert tokenizer_digest(d) != worker_before
    assert _dir_digest(str(d)) != router_before
