"""``cpd analyze TRACE``: does CPD pay on my traffic?

Reads a Mooncake-format trace and prints (and writes ``report.md`` + PNGs):

1. prefix reuse: cached-prefix length and reuse-ratio distributions (infinite cache),
   cold/warm fractions at several thresholds, reuse distance (time since the prefix was
   last seen), LRU cache capacity needed for a fraction of the infinite-cache hit ratio;
2. for a model and GPU: recompute time versus load time per tier (L2 over PCIe, L3 over
   the NIC) at the observed prefix lengths;
3. a verdict: whether cold prefills would block warm ones under plain P/D at the stated
   load (M/G/1 Pollaczek-Khinchine wait of the shared prefill queue: blocking when the
   mean wait exceeds max(0.1 s, 2x the warm service time) and cold requests cause most
   of it), the gain of CPD from a quick simulation (``reference_b200`` cluster
   shapes, the trace replayed with time scaling), and a suggested GPU split between
   pre-prefill, prefill and decode in proportion to their modeled busy time.

Mountable: ``app.command("analyze")(analyze)``; also ``python -m cpd.analyze.cli TRACE``.
"""
from __future__ import annotations

import copy
from pathlib import Path

import typer


def _pct(xs, q):
    from cpd.analyze.stats import _pct as p
    return p(xs, q)


def analyze(
    trace: Path = typer.Argument(..., help="Mooncake JSONL trace (timestamp ms, input_length, output_length, hash_ids)"),
    out: Path = typer.Option(Path("analyze_out"), "--out", "-o", help="folder for report.md and PNGs"),
    model: str = typer.Option("Llama-3.1-8B", help="shipped model name or config.json path"),
    gpu: str = typer.Option("B200", help="B200 | H200 | H100"),
    tp: int = typer.Option(4, help="tensor-parallel degree of a prefill instance"),
    kv_dtype_bytes: float = typer.Option(1.0, help="bytes per KV element"),
    qps_per_gpu: float = typer.Option(0.8, help="load at which the blocking verdict is stated (QPS per GPU of 2P1D)"),
    cold_threshold: float = typer.Option(0.5, help="reuse below this = cold"),
    total_gpus: int = typer.Option(16, help="GPUs to split between pre-prefill, prefill and decode"),
    simulate: bool = typer.Option(True, help="run the quick 2P1D vs CPD simulation"),
    sim_steady_s: float = typer.Option(120.0, help="steady window of each quick-simulation point (s)"),
) -> None:
    """Analyse a trace's prefix reuse and say whether cache-aware P/D (CPD) pays on it."""
    from cpd.analyze.stats import capacity_for, reuse_profile
    from cpd.policy.cost_model import RooflineCostModel
    from cpd.sim.workload import load_mooncake

    reqs = load_mooncake(trace)
    if not reqs:
        raise typer.BadParameter("empty trace")
    out.mkdir(parents=True, exist_ok=True)
    prof = reuse_profile(reqs)
    cost = RooflineCostModel.build(model, gpu, tp=tp, kv_dtype_bytes=kv_dtype_bytes)
    dcost = RooflineCostModel.build(model, gpu, tp=1, kv_dtype_bytes=kv_dtype_bytes)
    dur = max(1e-9, reqs[-1].arrival_s - reqs[0].arrival_s)
    L: list[str] = [f"# cpd analyze: {trace.name}", ""]
    L.append(f"{len(reqs)} requests over {dur:.0f} s ({len(reqs) / dur:.2f} req/s); "
             f"prompt p50/p90 {_pct([r.prompt_tokens for r in reqs], .5):.0f}/{_pct([r.prompt_tokens for r in reqs], .9):.0f} "
             f"tokens, output mean {sum(r.output_tokens for r in reqs) / len(reqs):.0f}.")
    L += ["", "## Prefix reuse (infinite cache, 512-token blocks)", "",
          f"* token hit ratio: **{prof.token_hit_ratio * 100:.1f} %**",
          f"* cached prefix tokens p50/p90/p99: {_pct(prof.cached_tokens, .5):.0f} / {_pct(prof.cached_tokens, .9):.0f} / "
          f"{_pct(prof.cached_tokens, .99):.0f}",
          f"* reuse ratio p25/p50/p75: {_pct(prof.reuse, .25):.2f} / {_pct(prof.reuse, .5):.2f} / {_pct(prof.reuse, .75):.2f}"]
    for th in (0.25, 0.5, 0.75):
        cold = sum(1 for x in prof.reuse if x < th) / len(reqs)
        L.append(f"* threshold {th}: cold {cold * 100:.1f} %, warm {(1 - cold) * 100:.1f} %")
    if prof.reuse_distance_s:
        rd = prof.reuse_distance_s
        L.append(f"* reuse distance (hit >= 2 blocks) p50/p90/p99: {_pct(rd, .5):.0f} / {_pct(rd, .9):.0f} / {_pct(rd, .99):.0f} s")
    cap, curve = capacity_for(reqs, 0.9)
    bb = 512 * cost.kv_bytes_per_token
    L.append(f"* LRU capacity for 90 % of the infinite hit ratio: {cap} blocks = {cap * bb / 1e12:.2f} TB of KV "
             f"({model}, {kv_dtype_bytes:g} B/elem)")
    L.append("* LRU curve: " + ", ".join(f"{c} blk → {h * 100:.1f} %" for c, h in curve))
    # recompute vs load
    L += ["", f"## Recompute vs load ({model} on {tp}x{gpu})", "",
          "| prefix tokens | recompute (s) | load L2 (s) | load L3 (s) | best |", "|---:|---:|---:|---:|---|"]
    for q in (.5, .9, .99):
        p = max(512, int(_pct([c for c in prof.cached_tokens if c > 0] or [512], q)))
        rc = cost.prefill_time_s(p, 0)
        l2 = cost.load_time_s("L2", p * cost.kv_bytes_per_token)
        l3 = cost.load_time_s("L3", p * cost.kv_bytes_per_token)
        best = min((rc, "recompute"), (l2, "L2"), (l3, "L3"))[1]
        L.append(f"| {p} (p{int(q * 100)}) | {rc:.3f} | {l2:.3f} | {l3:.3f} | {best} |")
    # blocking verdict: M/G/1 on the shared prefill queue of 2 prefill instances (as one server of 2x speed)
    svc, cold_svc, warm_svc = [], [], []
    for r, c, u in zip(reqs, prof.cached_tokens, prof.reuse):
        s = cost.prefill_time_s(r.prompt_tokens - c, c) + (cost.load_time_s("L3", c * cost.kv_bytes_per_token) if c else 0)
        s /= 2.0
        svc.append(s)
        (cold_svc if u < cold_threshold else warm_svc).append(s)
    lam = qps_per_gpu * 12
    es = sum(svc) / len(svc)
    es2 = sum(x * x for x in svc) / len(svc)
    rho = lam * es
    L += ["", "## Verdict", ""]
    warm_mean = sum(warm_svc) / max(1, len(warm_svc))
    if rho >= 1:
        L.append(f"* at {qps_per_gpu} QPS/GPU ({lam:.1f} QPS on 2P1D) the shared prefill pool is overloaded (ρ = {rho:.2f}).")
        block = True
    else:
        wq = lam * es2 / (2 * (1 - rho))
        lc = len(cold_svc) / len(svc)
        share = lc * sum(x * x for x in cold_svc) / len(cold_svc) / es2 if cold_svc else 0.0
        block = wq > max(0.1, 2 * warm_mean) and share > 0.5
        L.append(f"* cold requests cause {share * 100:.0f} % of the queueing delay (share of E[S²])")
        L.append(f"* plain P/D (2P1D) at {qps_per_gpu} QPS/GPU ({lam:.1f} QPS): prefill utilisation ρ = {rho:.2f}, "
                 f"mean wait in the shared queue {wq:.2f} s vs warm service {warm_mean:.3f} s → "
                 + ("**cold prefills block warm ones**" if block else "little blocking"))
    # GPU split by modeled busy time
    pre_w = sum(cold_svc) * 2
    pf_w = sum(warm_svc) * 2
    ctx = sum(r.prompt_tokens for r in reqs) / len(reqs)
    dec_w = sum(r.output_tokens for r in reqs) * dcost.decode_step_time_s(16, int(16 * ctx)) / 16 / tp
    tot = pre_w + pf_w + dec_w
    split = {k: v / tot * total_gpus for k, v in (("pre-prefill", pre_w), ("prefill", pf_w), ("decode", dec_w))}
    nodes = {k: max(1, round(v / 4)) for k, v in split.items()}
    L.append("* suggested split of %d GPUs by modeled busy time: " % total_gpus
             + ", ".join(f"{k} {v:.1f} GPUs (≈{nodes[k]} node(s) of 4)" for k, v in split.items()))
    gain_txt = None
    if simulate:
        cap = 1.0 / (es * 12)  # QPS/GPU at which the shared 2P prefill pool would be 100 % busy
        pts = sorted({round(cap * f, 2) for f in (0.3, 0.5, 0.7, 0.9, 1.1, 1.3)})
        gain_txt = _quick_sim(trace, sim_steady_s, model, gpu, kv_dtype_bytes, pts, nodes)
        L.append(f"* quick simulation (trace time-scaled, {sim_steady_s:.0f} s steady per point): {gain_txt}")
    L.append("* **CPD pays** on this traffic." if (block and prof.token_hit_ratio > 0.2) else
             "* CPD is unlikely to pay much here (little blocking or little reuse).")
    _plots(prof, curve, out)
    L += ["", "![reuse](reuse.png)", "", "![lru](lru_curve.png)", ""]
    text = "\n".join(L) + "\n"
    (out / "report.md").write_text(text)
    typer.echo(text)


def _quick_sim(trace: Path, steady_s: float, model: str, gpu: str, kvb: float, pts: list[float],
               nodes: dict[str, int]) -> str:
    from cpd.sim.experiment import load_experiment
    from cpd.sim.sweep import run_sweep
    exp = copy.deepcopy(load_experiment("reference_b200"))
    exp.update(model=model, gpu=gpu, kv_dtype_bytes=kvb, steady_s=steady_s, ramp_s=10, drain_s=30)
    exp["workload"] = {"kind": "mooncake", "path": str(trace), "spread_ticks_s": 3.0}
    exp["configs"] = {k: exp["configs"][k] for k in ("2P1D", "CPD-1D")}
    exp["configs"]["CPD-split"] = {"topology": "cpd", "pre_prefill": nodes["pre-prefill"],
                                   "prefill": nodes["prefill"], "decode": nodes["decode"]}
    exp["qps_per_gpu"] = pts
    r = run_sweep(exp, progress=False)
    s = r["saturation"]

    def g(c):
        v = r["gain_vs"]["2P1D"][c]
        return "n/a" if v is None else f"{v * 100:+.0f} %"
    return (f"loads {pts} QPS/GPU; saturation (TTFT p90 <= {r['slo']['ttft_p90_s']} s) 2P1D "
            f"{s['2P1D']['qps_per_gpu']}, CPD-1D (1+1+1 nodes) {s['CPD-1D']['qps_per_gpu']} ({g('CPD-1D')}), "
            f"CPD with the suggested split {s['CPD-split']['qps_per_gpu']} QPS/GPU ({g('CPD-split')} vs 2P1D)")


def _plots(prof, curve, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    ax[0].hist(prof.reuse, bins=20, range=(0, 1))
    ax[0].set_xlabel("reuse ratio")
    ax[0].set_ylabel("requests")
    xs = sorted(prof.cached_tokens)
    ax[1].plot(xs, [i / len(xs) for i in range(len(xs))])
    ax[1].set_xlabel("cached prefix tokens")
    ax[1].set_ylabel("CDF")
    if prof.reuse_distance_s:
        d = sorted(prof.reuse_distance_s)
        ax[2].plot(d, [i / len(d) for i in range(len(d))])
        ax[2].set_xscale("log")
    ax[2].set_xlabel("reuse distance (s)")
    ax[2].set_ylabel("CDF")
    fig.tight_layout()
    fig.savefig(out / "reuse.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.8))
    ax.plot([c for c, _ in curve], [h * 100 for _, h in curve], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("LRU capacity (512-token blocks)")
    ax.set_ylabel("token hit ratio (%)")
    fig.tight_layout()
    fig.savefig(out / "lru_curve.png", dpi=100)
    plt.close(fig)


app = typer.Typer(add_completion=False)
app.command("analyze")(analyze)

if __name__ == "__main__":
    typer.run(analyze)
