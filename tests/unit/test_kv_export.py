"""KV export for the handoff straight into a destination buffer (``Engine.export_kv_into``):
same bytes as ``export_kv`` for a torch tensor, a numpy byte buffer and a shared-memory
segment, at float32 and bfloat16, with partial last blocks; wrong sizes are refused; the
exported KV continues on another engine with the oracle's tokens."""
from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from cpd.engine.engine import Engine, EngineRequest
from cpd.engine.sampling import SamplingParams
from cpd.engine.weights import make_tiny_llama_dir

BS = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def _held(e: Engine, rid: str, prompt: list[int]) -> None:
    e.add_request(EngineRequest(rid, prompt, GREEDY, mode="prefill"))
    while e.has_unfinished():
        e.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [17, 24])  # partial last block, exact blocks
def test_export_into_buffers_equals_export(model_dir, dtype, n):
    e = Engine(model_dir, num_blocks=32, block_size=BS, dtype=dtype)
    prompt = torch.randint(10, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    _held(e, "a", prompt)
    ref, toks = e.export_kv("a")
    shape = e.export_kv_shape("a")
    assert tuple(ref.shape) == shape
    nbytes = ref.numel() * ref.element_size()
    assert nbytes == shape[2] * e.kv_bytes_per_token
    t = torch.empty(shape, dtype=dtype)
    assert e.export_kv_into("a", t) == toks and torch.equal(t, ref)
    buf = np.zeros(nbytes, dtype=np.uint8)
    e.export_kv_into("a", buf)
    assert bytes(buf) == ref.contiguous().view(torch.uint8).numpy().tobytes()
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        e.export_kv_into("a", shm.buf)
        assert bytes(shm.buf[:nbytes]) == bytes(buf)
    finally:
        shm.close()
        shm.unlink()
    with pytest.raises((ValueError, RuntimeError)):
        e.export_kv_into("a", np.zeros(nbytes - 2, dtype=np.uint8))
    with pytest.raises(KeyError):
        e.export_kv_into("nope", buf)
    e.release("a")


def test_exported_kv_decodes_to_oracle_tokens(model_dir):
    prompt = torch.randint(10, 40000, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    want = Engine(model_dir, num_blocks=32, block_size=BS).generate(prompt, GREEDY)
    pre = Engine(model_dir, num_blocks=32, block_size=BS)
    _held(pre, "h", prompt)
    shape = pre.export_kv_shape("h")
    buf = bytearray(shape[2] * pre.kv_bytes_per_token)
    toks = pre.export_kv_into("h", buf)
    pre.release("h")
    kv = torch.frombuffer(buf, dtype=torch.float32).view(shape)  # what the decode side receives
    dec = Engine(model_dir, num_blocks=32, block_size=BS)
    dec.add_decode_request("d", toks, kv, GREEDY)
    out = list(toks[len(prompt):])
    while dec.has_unfinished():
        for o in dec.step():
            out.extend(o.new_token_ids)
    assert out == want
