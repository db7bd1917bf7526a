"""Model math vs ``transformers.LlamaForCausalLM`` (tiny random configs and the real SmolLM2).

Tolerance: max |logit difference| < 1e-3 in float32 (measured: ~5e-6 on the tiny
models, ~7e-5 on SmolLM2-135M), and identical greedy tokens.
"""
from __future__ import annotations

import pytest
import torch

from cpd.engine.engine import Engine
from cpd.engine.model import SeqBatchInfo, build_metadata
from cpd.engine.sampling import SamplingParams
from cpd.engine.weights import default_model_dir, load_model_dir, make_tiny_llama_dir, read_config

TOL = 1e-3
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


def _hf(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _full_logits(model, cfg, ids: torch.Tensor, block_size=16, block_table=None):
    nb = -(-len(ids) // block_size)
    table = block_table or list(range(nb))[::-1]  # deliberately non-contiguous order
    kv = torch.zeros(cfg.num_hidden_layers, 2, max(table) + 1, block_size, cfg.num_key_value_heads, cfg.head_dim)
    meta = build_metadata([SeqBatchInfo(0, len(ids), table)], block_size)
    return model(ids, meta, kv), kv


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", [
    {},
    {"tie_word_embeddings": True, "rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0, "seed": 3},
], ids=["plain", "tied-llama3rope"])
def test_tiny_model_matches_transformers(tmp_path, variant):
    d = make_tiny_llama_dir(tmp_path / "m", **variant)
    model, cfg = load_model_dir(d)
    hf = _hf(d)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=g)
    ours, _ = _full_logits(model, cfg, ids, block_size=8)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() < TOL
    # greedy tokens through the engine == transformers' generate
    eng = Engine(d, num_blocks=32, block_size=8)
    prompt = ids[:13].tolist()
    got = eng.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == _hf_greedy(hf, prompt, 20)
    assert eng.pool.stats()["num_in_use"] == 0


def test_chunked_and_batched_forward_equal_full(tmp_path):
    d = make_tiny_llama_dir(tmp_path / "m", seed=1)
    model, cfg = load_model_dir(d)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, cfg.vocab_size, (21,), generator=g)
    b = torch.randint(0, cfg.vocab_size, (9,), generator=g)
    ref_a, _ = _full_logits(model, cfg, a, 4, list(range(6)))
    ref_b, _ = _full_logits(model, cfg, b, 4, list(range(3)))
    # a: first 10 tokens, then (11 tokens of a + all of b) in one flat batch
    kv = torch.zeros(cfg.num_hidden_layers, 2, 16, 4, cfg.num_key_value_heads, cfg.head_dim)
    ta, tb = [7, 3, 9, 1, 12, 5], [2, 14, 0]
    o1 = model(a[:10], build_metadata([SeqBatchInfo(0, 10, ta)], 4), kv)
    meta = build_metadata([SeqBatchInfo(10, 11, ta), SeqBatchInfo(0, 9, tb)], 4)
    o2 = model(torch.cat([a[10:], b]), meta, kv)
    assert (torch.cat([o1, o2[:11]]) - ref_a).abs().max().item() < 1e-4
    assert (o2[11:] - ref_b).abs().max().item() < 1e-4
    # logits_indices selects rows
    kv2 = torch.zeros_like(kv)
    sel = model(torch.cat([a, b]), build_metadata([SeqBatchInfo(0, 21, ta), SeqBatchInfo(0, 9, tb)], 4), kv2,
                torch.tensor([20, 29]))
    assert sel.shape == (2, cfg.vocab_size)
    assert (sel[0] - ref_a[-1]).abs().max().item() < 1e-4


def test_batched_decode_matches_per_sequence_path(tmp_path):
    """One-token rows of very different context lengths, batched (padded gather + mask) and
    mixed with prefill chunks, give the logits of the per-sequence path and of full forwards."""
    d = make_tiny_llama_dir(tmp_path / "m", seed=2, num_heads=6, num_kv_heads=2)
    model, cfg = load_model_dir(d)
    g = torch.Generator().manual_seed(3)
    lens = [1, 2, 37, 5, 80]
    seqs = [torch.randint(0, cfg.vocab_size, (n + 1,), generator=g) for n in lens]
    bsz, nblk = 4, 24
    tables = [list(range(i * nblk, (i + 1) * nblk))[::-1] for i in range(len(lens))]
    chunk = torch.randint(0, cfg.vocab_size, (7,), generator=g)
    results = {}
    for batched in (True, False):
        model.batched_decode = batched
        kv = torch.zeros(cfg.num_hidden_layers, 2, (len(lens) + 1) * nblk, bsz, cfg.num_key_value_heads,
                         cfg.head_dim)
        for s, t, n in zip(seqs, tables, lens):  # prefill each prompt alone
            model(s[:n], build_metadata([SeqBatchInfo(0, n, t)], bsz), kv)
        # decode rows + a prefill chunk (placed in the middle of the flat batch)
        infos = [SeqBatchInfo(n, 1, t) for n, t in zip(lens, tables)]
        ids = [s[n:n + 1] for s, n in zip(seqs, lens)]
        infos.insert(2, SeqBatchInfo(0, 7, list(range(len(lens) * nblk, (len(lens) + 1) * nblk))))
        ids.insert(2, chunk)
        meta = build_metadata(infos, bsz)
        results[batched] = model(torch.cat(ids), meta, kv, meta.last_token_indices)
        # decode-only step (every row one token)
        infos2 = [SeqBatchInfo(n, 1, t) for n, t in zip(lens, tables)]
        meta2 = build_metadata(infos2, bsz)
        kv_copy = kv.clone()
        results[(batched, "dec")] = model(torch.cat(ids[:2] + ids[3:]), meta2, kv_copy)
    model.batched_decode = True
    assert (results[True] - results[False]).abs().max().item() < 1e-4
    assert torch.equal(results[True].argmax(-1), results[False].argmax(-1))
    assert (results[(True, "dec")] - results[(False, "dec")]).abs().max().item() < 1e-4
    for j, (s, n) in enumerate(zip(seqs, lens)):  # vs one full forward of the n+1 tokens
        ref, _ = _full_logits(model, cfg, s, bsz, list(range(nblk)))
        row = j if j < 2 else j + 1
        assert (results[True][row] - ref[-1]).abs().max().item() < 1e-4
    ref_chunk, _ = _full_logits(model, cfg, chunk, bsz, list(range(2)))
    assert (results[True][2] - ref_chunk[-1]).abs().max().item() < 1e-4


def test_config_reads_rope_parameters_layout(tmp_path):
    d = make_tiny_llama_dir(tmp_path / "m", rope_theta=1234.0)
    assert read_config(d).rope_theta == 1234.0
    with pytest.raises(ValueError):
        build_metadata([SeqBatchInfo(0, 9, [0, 1])], 4)


@pytest.mark.slow
def test_smollm2_matches_transformers():
    from transformers import AutoTokenizer

    d = default_model_dir()
    model, cfg = load_model_dir(d)
    assert cfg.num_hidden_layers == 30 and cfg.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(str(d))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    prompt = list(prompt)
    hf = _hf(d)
    ids = torch.tensor(prompt)
    ours, _ = _full_logits(model, cfg, ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max().item() < TOL
    del model
    eng = Engine(d, num_blocks=16, block_size=16)
    got = eng.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == _hf_greedy(hf, prompt, 20)
    assert "Paris" in tok.decode(got)


def test_digests_track_content(tmp_path):
    from cpd.engine.weights import tokenizer_digest, weights_digest

    a = make_tiny_llama_dir(tmp_path / "a", seed=0)
    b = make_tiny_llama_dir(tmp_path / "b", seed=0)
    c = make_tiny_llama_dir(tmp_path / "c", seed=1)
    assert weights_digest(a) == weights_digest(b) != weights_digest(c)
    assert weights_digest(a) == weights_digest(a)  # deterministic, computed from content each time
    assert tokenizer_digest(a) == tokenizer_digest(c) and len(tokenizer_digest(a)) == 32
    (a / "tokenizer.json").write_text((a / "tokenizer.json").read_text() + " ")
    assert tokenizer_digest(a) != tokenizer_digest(c)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_equal_length_prefills_batched_in_one_sdpa_call(tmp_path, dtype, tol):
    """Equal-length fresh sequences take the batched SDPA path; mixed with a different length
    and a chunk on a cached prefix in the same flat batch, each row equals its own full forward."""
    d = make_tiny_llama_dir(tmp_path / "m", seed=4, num_heads=6, num_kv_heads=2)
    model, cfg = load_model_dir(d, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, cfg.vocab_size, (12,), generator=g) for _ in range(3)]
    other = torch.randint(0, cfg.vocab_size, (7,), generator=g)
    grown = torch.randint(0, cfg.vocab_size, (15,), generator=g)
    kv = torch.zeros(cfg.num_hidden_layers, 2, 40, 4, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    tables = [[3 * i + 2, 3 * i + 1, 3 * i] for i in range(3)] + [[20, 19], [30, 28, 26, 24]]
    model(grown[:9], build_metadata([SeqBatchInfo(0, 9, tables[4])], 4), kv)  # cached prefix of `grown`
    infos = [SeqBatchInfo(0, 12, t) for t in tables[:3]] + [SeqBatchInfo(0, 7, tables[3]),
                                                             SeqBatchInfo(9, 6, tables[4])]
    out = model(torch.cat(seqs + [other, grown[9:]]), build_metadata(infos, 4), kv)
    rows = torch.split(out, [12, 12, 12, 7, 6])
    for s, r in zip(seqs + [other], rows):
        kv1 = torch.zeros(cfg.num_hidden_layers, 2, 8, 4, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
        ref = model(s, build_metadata([SeqBatchInfo(0, len(s), list(range(-(-len(s) // 4))))], 4), kv1)
        assert (r - ref).abs().max().item() < tol
    kv1 = torch.zeros(cfg.num_hidden_layers, 2, 8, 4, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    ref = model(grown, build_metadata([SeqBatchInfo(0, 15, [0, 1, 2, 3])], 4), kv1)
    assert (rows[4] - ref[9:]).abs().max().item() < tol


def _engine_tokens(d, prompts, sp, seq_kv_bytes, **sched):
    """Greedy/sampled tokens of ``prompts`` run together on one engine; and its executor."""
    from cpd.engine.engine import EngineRequest
    from cpd.engine.scheduler import SchedulerConfig

    eng = Engine(d, num_blocks=sched.pop("num_blocks", 256), block_size=4,
                 scheduler_config=SchedulerConfig(**sched))
    eng.executor.seq_kv.max_bytes = seq_kv_bytes
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(f"r{i}", p, sp))
    out: dict[str, list[int]] = {}
    peak_rows_bytes = 0
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        peak_rows_bytes = max(peak_rows_bytes, eng.executor.seq_kv.nbytes)
    assert eng.pool.stats()["num_in_use"] == 0
    return [out[f"r{i}"] for i in range(len(prompts))], eng.executor, peak_rows_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seq_kv_rows_give_the_gather_paths_tokens(tmp_path, dtype):
    """Decode rows and prefill chunks reading contiguous per-sequence rows (no per-step block
    gather) give exactly the greedy tokens of the pool-gather path: very different lengths,
    chunked prefill mixed with decode rows, sequences finishing and joining (rows reused),
    preemption under block pressure; each row is filled from the pool about once per
    sequence, the storage stays within its cap and is kept (rows forgotten) when no sequence
    needs it, so that the next request does not allocate it again."""
    d = make_tiny_llama_dir(tmp_path / "m", seed=6, num_heads=6, num_kv_heads=2)
    g = torch.Generator().manual_seed(9)
    lens = [3, 150, 17, 64, 1, 97, 40]
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    sched = dict(max_num_batched_tokens=48, max_prefill_chunk_tokens=32, max_num_seqs=5)
    import cpd.engine.executor_torch as ex
    from cpd.engine.dtype import resolve_dtype
    orig = ex.TorchExecutor.__init__

    def init(self, *a, **kw):  # the engine's dtype for this test
        kw["dtype"] = resolve_dtype(dtype)
        orig(self, *a, **kw)
    ex.TorchExecutor.__init__ = init  # type: ignore[method-assign]
    try:
        ref, ref_ex, ref_bytes = _engine_tokens(d, prompts, sp, 0, **sched)
        got, got_ex, got_bytes = _engine_tokens(d, prompts, sp, None, **sched)
        assert ref_bytes == 0 and ref_ex.seq_kv.num_refills == 0
        assert got == ref
        arena = got_ex.seq_kv
        assert 0 < got_bytes <= arena.peak_bytes and arena.nbytes == arena.peak_bytes  # kept when idle
        assert not arena._rows and not arena._by_seq  # ... with every row forgotten
        # a sequence's row is filled from the pool when it first continues on cached tokens
        # (again after an interruption), not every step: >= 11 decode steps per sequence
        assert arena.num_row_steps >= 11 * len(lens) and 0 < arena.num_refills <= 2 * len(lens)
        # block pressure: preemptions drop and refill rows
        got_p, ex_p, _ = _engine_tokens(d, prompts[:4], sp, None, num_blocks=60, **sched)
        ref_p, _, _ = _engine_tokens(d, prompts[:4], sp, 0, num_blocks=60, **sched)
        assert got_p == ref_p
        # a cap below the need: the step falls back to the gather (counted), same tokens
        cap = 4 * 100 * 2 * 2 * 2 * 16 * (2 if dtype == "bfloat16" else 4)
        got_c, ex_c, bytes_c = _engine_tokens(d, prompts, sp, cap, **sched)
        assert got_c == ref and ex_c.seq_kv.num_fallbacks > 0 and bytes_c <= cap
    finally:
        ex.TorchExecutor.__init__ = orig  # type: ignore[method-assign]


def test_seq_kv_storage_follows_the_step_need():
    """A new storage is sized by the step that needs it (at most 4x its rows x tokens), not
    by an earlier wider batch: one long row after 32 short ones must not allocate 32 long
    rows (that zeroed GBs in one step, 8-13 s of one SmolLM2 prefill). Rows kept across the
    reallocation keep their tokens (moved to the first rows); a batch growing one sequence
    at a time reallocates O(log n) times."""
    from types import SimpleNamespace as NS

    from cpd.engine.seq_kv import SeqKVArena

    L, blocks, bs, H, D = 2, 256, 4, 1, 2
    kv = torch.arange(L * 2 * blocks * bs * H * D, dtype=torch.float32).view(L, 2, blocks, bs, H, D)
    per_token = L * 2 * H * D * 4
    ar = SeqKVArena(torch.float32, torch.device("cpu"))
    wide = [NS(num_computed=3, num_new=1, blocks=[i], token_ids=list(range(8))) for i in range(32)]
    assert ar.plan(wide, kv) is not None and ar.nbytes <= 4 * 32 * 4 * per_token
    toks = list(range(100))
    long_row = NS(num_computed=40, num_new=1, blocks=list(range(32, 43)), token_ids=toks)
    step = ar.plan([long_row], kv)
    assert step is not None and step.rows == [0]
    assert ar.nbytes <= 4 * 1 * 100 * per_token < 32 * 100 * per_token
    # a kept row survives a reallocation that grows the tokens, moved to row 0
    other = NS(num_computed=5, num_new=1, blocks=[50, 51], token_ids=list(range(8)))
    step = ar.plan([NS(num_computed=41, num_new=1, blocks=list(range(32, 43)), token_ids=toks), other], kv)
    assert step is not None and ar.num_refills == 32 + 1 + 1  # the wide rows, long_row, other
    longer = NS(num_computed=42, num_new=120, blocks=list(range(10, 50)), token_ids=toks + list(range(100)))
    # long_row's list object changed: a refill; `other` continues: kept and moved
    step = ar.plan([NS(num_computed=6, num_new=1, blocks=[50, 51], token_ids=other.token_ids), longer], kv)
    assert step is not None and step.rows == [0, 1] and ar.num_refills == 35 and ar.buf.shape[4] >= 162
    got = step.buf[:, :, step.rows[0], :, :6]
    assert torch.equal(got, torch.cat([kv[:, :, 50], kv[:, :, 51, :2]], 2).transpose(2, 3))
    ar.reset()
    grows = 0
    for n in range(1, 33):  # one more sequence per step
        before = ar.buf
        ar.plan([NS(num_computed=3, num_new=1, blocks=[i], token_ids=wide[i].token_ids) for i in range(n)], kv)
        grows += ar.buf is not before
    assert grows <= 7


def test_seq_kv_row_validity_rules():
    """A row is reused only for the same token list object, the same length and the same
    blocks; a sequence absent from a step loses its row; no sequence that continues = no
    rows (the storage is kept for the next ones; :meth:`reset` releases it)."""
    from types import SimpleNamespace as NS

    from cpd.engine.seq_kv import SeqKVArena

    kv = torch.arange(2 * 2 * 8 * 4 * 1 * 2, dtype=torch.float32).view(2, 2, 8, 4, 1, 2)
    ar = SeqKVArena(torch.float32, torch.device("cpu"))
    toks = list(range(10))
    s = NS(num_computed=6, num_new=1, blocks=[5, 2], token_ids=toks)
    step = ar.plan([s], kv)
    assert step is not None and step.rows == [0] and ar.num_refills == 1
    # the row holds the pool's 6 tokens (blocks 5 then 2), in order
    assert torch.equal(step.buf[:, :, 0, :, :6], torch.cat([kv[:, :, 5], kv[:, :, 2, :2]], 2).transpose(2, 3))
    ar.plan([NS(num_computed=7, num_new=1, blocks=[5, 2], token_ids=toks)], kv)
    assert ar.num_refills == 1  # valid: appended only
    ar.plan([NS(num_computed=8, num_new=1, blocks=[5, 3], token_ids=toks)], kv)
    assert ar.num_refills == 2  # other blocks: refilled
    step = ar.plan([NS(num_computed=9, num_new=1, blocks=[5, 3, 4], token_ids=list(toks))], kv)
    assert ar.num_refills == 3  # another token list: refilled
    # copied per run of consecutive block ids ([5], [3, 4]): the same rows as a gather
    want = torch.cat([kv[:, :, 5], kv[:, :, 3], kv[:, :, 4, :1]], 2).transpose(2, 3)
    assert step is not None and torch.equal(step.buf[:, :, 0, :, :9], want)
    fresh = NS(num_computed=0, num_new=9, blocks=[1, 6, 7], token_ids=list(range(9)))
    kept = ar.nbytes
    assert ar.plan([fresh], kv) is None and not ar._rows and ar.nbytes == kept > 0  # one-step prefill: no row
    first_chunk = NS(num_computed=0, num_new=4, blocks=[1, 6, 7], token_ids=list(range(9)))
    step = ar.plan([first_chunk], kv)
    assert step is not None and step.rows == [0] and ar.num_refills == 3  # nothing cached to copy
    ar.reset()
    assert ar.nbytes == 0 and ar.buf is None
