"""cpd.engine.cpu_blas (float32 prefill linears through numpy's OpenBLAS) and the last layer
computing only the rows whose logits are wanted."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpd.engine import cpu_blas
from cpd.engine.model import SeqBatchInfo, build_metadata
from cpd.engine.weights import load_model_dir, make_tiny_llama_dir

needs_openblas = pytest.mark.skipif(cpu_blas._set_threads_fn() is None, reason="numpy has no OpenBLAS here")


@needs_openblas
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided-rows"])
def test_linear_matches_torch(strided):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(40, 96, generator=g)
    x = base[:, :48] if strided else base[:, :48].contiguous()
    w, b = torch.randn(24, 48, generator=g), torch.randn(24, generator=g)
    got = cpu_blas.linear(x, w, b)
    assert got.shape == (40, 24) and got.dtype == torch.float32
    assert (got - F.linear(x, w, b)).abs().max().item() < 1e-4


@needs_openblas
def test_linear_follows_torch_threads():
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cpu_blas.linear(torch.randn(20, 8), torch.randn(4, 8))
            assert cpu_blas._threads[0] == n
    finally:
        torch.set_num_threads(before)


def test_policy(monkeypatch):
    cpu = torch.device("cpu")
    assert not cpu_blas.wanted(torch.device("meta"), torch.float32)
    assert not cpu_blas.wanted(cpu, torch.bfloat16)
    monkeypatch.setenv("CPD_CPU_GEMM", "torch")
    assert not cpu_blas.wanted(cpu, torch.float32)
    monkeypatch.setenv("CPD_CPU_GEMM", "openblas")
    assert cpu_blas.wanted(cpu, torch.float32) == (cpu_blas._set_threads_fn() is not None)
    monkeypatch.setenv("CPD_CPU_GEMM", "auto")
    want = cpu_blas._set_threads_fn() is not None and cpu_blas._cpu_vendor() not in ("GenuineIntel", "")
    assert cpu_blas.wanted(cpu, torch.float32) == want


@pytest.mark.parametrize("gemm", ["torch", "openblas"])
def test_wanted_rows_equal_full_forward_rows(tmp_path, monkeypatch, gemm):
    """Logits of selected rows (the last layer computes only them) equal those rows of the
    all-rows forward, over a two-sequence prefill batch; the K/V written are the same."""
    if gemm == "openblas" and cpu_blas._set_threads_fn() is None:
        pytest.skip("numpy has no OpenBLAS here")
    monkeypatch.setenv("CPD_CPU_GEMM", gemm)
    d = make_tiny_llama_dir(tmp_path / "m")
    model, cfg = load_model_dir(d)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=g)
    infos = [SeqBatchInfo(0, 23, [0, 1, 2]), SeqBatchInfo(0, 17, [3, 4, 5])]

    def run(rows):
        kv = torch.zeros(cfg.num_hidden_layers, 2, 6, 8, cfg.num_key_value_heads, cfg.head_dim)
        return model(ids, build_metadata(infos, 8), kv, rows), kv

    full, kv_full = run(None)
    rows = torch.tensor([22, 39, 5])
    some, kv_some = run(rows)
    assert some.shape == (3, cfg.vocab_size)
    assert (some - full[rows]).abs().max().item() < 1e-4
    assert torch.equal(kv_some, kv_full)
