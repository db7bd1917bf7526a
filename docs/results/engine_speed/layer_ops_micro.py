"""Issue 13, session 8 (AMD EPYC, AVX2): one decoder layer's non-matmul pieces at T tokens, old form vs the
fewer-op form (RMSNorm, RoPE, K/V pool and arena writes), min of 5 x 2000 calls, thread CPU us, and their equality.
Usage: PYTHONPATH=. python layer_ops_micro.py T"""
import sys, time, torch, statistics
import torch.nn.functional as F
torch.set_num_threads(1)
T = int(sys.argv[1])
def tm(f, n=2000):
    f(); best = []
    for _ in range(5):
        t = time.thread_time()
        for _ in range(n): f()
        best.append((time.thread_time() - t) / n * 1e6)
    return round(min(best), 2)
x = torch.randn(T, 576); w = torch.rand(576) + 0.5
def rms_ref():
    xf = x.float(); xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5); return w * xf.to(x.dtype)
def rms_fused(): return F.rms_norm(x, (576,), w, 1e-5)
print(T, 'rms ref', tm(rms_ref), 'fused', tm(rms_fused), 'maxdiff', (rms_ref() - rms_fused()).abs().max().item())
qkv = torch.randn(T, 960)
cos = torch.randn(T, 1, 64); sin = torch.randn(T, 1, 64)
ssin = torch.cat((-sin[..., :32], sin[..., 32:]), -1)
def rot_half(x):
    h = x.shape[-1] // 2; return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
def rope_ref(a):
    qk = a[:, :768].view(T, 12, 64); r = rot_half(qk).mul_(sin); qk.mul_(cos).add_(r); return a
def rope_roll(a):
    qk = a[:, :768].view(T, 12, 64); r = qk.roll(32, -1).mul_(ssin); qk.mul_(cos).add_(r); return a
def rope_addcmul(a):
    qk = a[:, :768].view(T, 12, 64); r = qk.roll(32, -1); qk.mul_(cos).addcmul_(r, ssin); return a
A = qkv.clone()
print(T, 'rope ref', tm(lambda: rope_ref(A)), 'roll', tm(lambda: rope_roll(A)), 'addcmul', tm(lambda: rope_addcmul(A)))
print('eq roll', torch.equal(rope_ref(qkv.clone()), rope_roll(qkv.clone())), 'eq addcmul', torch.equal(rope_ref(qkv.clone()), rope_addcmul(qkv.clone())),
      (rope_ref(qkv.clone()) - rope_addcmul(qkv.clone())).abs().max().item())
pool = torch.zeros(2, 2000 * 16, 3, 64); slots = torch.arange(160, 160 + T)
kv = qkv[:, 576:].view(T, 2, 3, 64)
def two():
    pool[0].index_copy_(0, slots, kv[:, 0]); pool[1].index_copy_(0, slots, kv[:, 1])
def one(): pool.index_copy_(1, slots, kv.transpose(0, 1))
print(T, 'pool 2 writes', tm(two), '1 write', tm(one))
ar = torch.zeros(2, 4, 3, 1024, 64); rows = torch.zeros(T, dtype=torch.int64); pos = torch.arange(100, 100 + T)
def a2():
    ar[0].transpose(1, 2).index_put_((rows, pos), kv[:, 0]); ar[1].transpose(1, 2).index_put_((rows, pos), kv[:, 1])
def a1(): ar.transpose(2, 3)[:, rows, pos] = kv.transpose(0, 1)
a1(); r1 = ar.clone(); ar.zero_(); a2(); print('arena eq', torch.equal(r1, ar))
print(T, 'arena 2 writes', tm(a2), '1 write', tm(a1))
