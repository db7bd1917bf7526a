import time, os, torch
torch.set_num_threads(1)
print("load", os.getloadavg(), flush=True)
def rms(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
x = torch.randn(8, 576, dtype=torch.bfloat16); w = torch.randn(576, dtype=torch.bfloat16)
t = time.perf_counter()
try:
    c = torch.compile(rms)
    c(x, w)
    print(f"torch.compile (inductor) of an RMSNorm: first call {time.perf_counter() - t:.1f} s", flush=True)
    for f, name in ((rms, "eager"), (c, "compiled")):
        for _ in range(5): f(x, w)
        ts = []
        for _ in range(200):
            t0 = time.process_time(); f(x, w); ts.append(time.process_time() - t0)
        ts.sort(); print(f"{name}: {ts[100]*1e6:.1f} us CPU per call", flush=True)
    print("max diff", (c(x, w).float() - rms(x, w).float()).abs().max().item())
except Exception as e:
    print("torch.compile failed after", round(time.perf_counter() - t, 1), "s:", repr(e)[:500])
print("load", os.getloadavg(), flush=True)
