"""The fewer-op forms the decoder layer uses for speed compute what the plain forms compute:
RoPE by one roll and a signed sin = the rotate_half formula (bit for bit), the fused float32
RMSNorm = the explicit formula, the K/V pool and arena writes of one op each = per-K/V writes."""
import pytest
import torch

from cpd.engine.model import RMSNorm, _signed_sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 130])
def test_roll_rope_equals_rotate_half_bitwise(dtype, T):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 12, 64, generator=g).to(dtype)
    ang = torch.rand(T, 1, 64, generator=g) * 100
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    ref = x * cos + _rotate_half(x) * sin
    ours = x.clone()
    rot = ours.roll(32, -1).mul_(_signed_sin(sin))
    ours.mul_(cos).add_(rot)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("T", [1, 16, 128])
def test_fused_rmsnorm_float32_matches_formula(T):
    g = torch.Generator().manual_seed(T)
    norm = RMSNorm(576, 1e-5, "cpu", torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
    x = torch.randn(T, 576, generator=g) * 3
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(norm(x), ref, rtol=1e-6, atol=1e-6)


def test_one_op_kv_writes_equal_per_kv_writes():
    g = torch.Generator().manual_seed(0)
    T, nkv, d = 5, 3, 8
    kv_new = torch.randn(T, 2, nkv, d, generator=g)
    pool_a, pool_b = torch.zeros(2, 4, 4, nkv, d), torch.zeros(2, 4, 4, nkv, d)
    slots = torch.tensor([3, 4, 9, 10, 15])
    pool_a.view(2, -1, nkv, d).index_copy_(1, slots, kv_new.transpose(0, 1))
    for i in range(2):
        pool_b[i].view(-1, nkv, d).index_copy_(0, slots, kv_new[:, i])
    assert torch.equal(pool_a, pool_b) and pool_a.abs().sum() > 0
    arena_a, arena_b = torch.zeros(2, 3, nkv, 16, d), torch.zeros(2, 3, nkv, 16, d)  # [2, rows, H, cap, D]
    rows, pos = torch.tensor([0, 0, 2, 2, 1]), torch.tensor([3, 4, 0, 1, 7])
    arena_a.transpose(2, 3)[:, rows, pos] = kv_new.transpose(0, 1)
    for i in range(2):
        arena_b[i].transpose(1, 2).index_put_((rows, pos), kv_new[:, i])
    assert torch.equal(arena_a, arena_b) and arena_a.abs().sum() > 0
