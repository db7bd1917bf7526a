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
    trace: Path = typer.Argument(..., help="trace: Mooncake JSONL, Claude Code folder or trace_*.json[.gz], Azure CSV"),
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
    large_suffix_tokens: int = typer.Option(8192, help="warm requests with more uncached tokens are warm_large"),
    session_rate: float = typer.Option(0.05, help="Claude Code: Poisson session starts per second for reuse distance"),
) -> None:
    """Analyse a trace's prefix reuse and say whether cache-aware P/D (CPD) pays on it."""
    from cpd.analyze.sessions import sessions_section
    from cpd.analyze.stats import capacity_for, reuse_profile
    from cpd.policy.cost_model import RooflineCostModel
    from cpd.sim.workload import schedule_to_sim
    from cpd.traces import ReplayOptions, Vocab, build_schedule, read_trace

    try:
        tr = read_trace(trace)
    except ValueError as e:  # TraceFormatError: file, line, what was expected — never a traceback
        typer.echo(f"cpd analyze: {e}", err=True)
        raise typer.Exit(2) from None
    opts = ReplayOptions(large_suffix_tokens=large_suffix_tokens, cold_threshold=cold_threshold,
                         session_rate=None if tr.timed else session_rate)
    sched = build_schedule(tr, opts, Vocab(2))
    if not sched:
        raise typer.BadParameter("empty trace")
    B = tr.block_tokens
    reqs = schedule_to_sim(sched, B, B)
    out.mkdir(parents=True, exist_ok=True)
    prof = reuse_profile(reqs, block_tokens=B)
    cost = RooflineCostModel.build(model, gpu, tp=tp, kv_dtype_bytes=kv_dtype_bytes)
    dcost = RooflineCostModel.build(model, gpu, tp=1, kv_dtype_bytes=kv_dtype_bytes)
    dur = max(1e-9, reqs[-1].arrival_s - reqs[0].arrival_s)
    L: list[str] = [f"# cpd analyze: {trace.name}", "",
                    f"Format {tr.format} ({tr.files} file(s), {len(tr.sessions)} session(s), {B}-token blocks); "
                    f"arrivals: {opts.arrival_model(tr)}."]
    if not tr.has_prefix_info:
        L += ["", "**This trace has no prefix information** (arrivals and lengths only): every request counts as "
              "new content, so the hit ratio below is 0 by construction. Model a shared prefix explicitly with "
              "`cpd bench/simulate --azure-prefix-tokens N` if you want one.", ""]
    span = "" if tr.timed else (f" (the trace has no absolute times: sessions placed by the arrival model above, "
                                f"at {session_rate:g} session starts/s)")
    L.append(f"{len(reqs)} requests over {dur:.0f} s{span} ({len(reqs) / dur:.2f} req/s); "
             f"prompt p50/p90 {_pct([r.prompt_tokens for r in reqs], .5):.0f}/{_pct([r.prompt_tokens for r in reqs], .9):.0f} "
             f"tokens, output mean {sum(r.output_tokens for r in reqs) / len(reqs):.0f}.")
    L += ["", f"## Prefix reuse (infinite cache, {B}-token blocks)", "",
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
    L += _uncached_section(sched, large_suffix_tokens, cost)
    cap, curve = capacity_for(reqs, 0.9, block_tokens=B)
    bb = B * cost.kv_bytes_per_token
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
    svc: list[float] = []
    cold_svc: list[float] = []
    warm_svc: list[float] = []
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
    verdict = "* **no supported verdict**: no simulation was run (--no-simulate); the queueing estimate above is not one."
    if simulate:
        cap_qps = 1.0 / (es * 12)  # QPS/GPU at which the shared 2P prefill pool would be 100 % busy
        pts = sorted({round(cap_qps * f, 2) for f in (0.3, 0.5, 0.7, 0.9, 1.1, 1.3)})
        gain_txt, verdict = _quick_sim(trace, tr, sim_steady_s, model, gpu, kv_dtype_bytes, pts, nodes, session_rate)
        L.append(f"* quick simulation ({sim_steady_s:.0f} s steady per point, arrivals as `cpd simulate --trace`): {gain_txt}")
    L.append(verdict)
    _plots(prof, curve, out, B)
    _kind_plots(sched, out, cost)
    L += ["", "![reuse](reuse.png)", "", "![lru](lru_curve.png)", "", "![uncached](uncached_cdf.png)"]
    L += sessions_section(tr, out) + [""]
    text = "\n".join(L) + "\n"
    (out / "report.md").write_text(text)
    typer.echo(text)


def _quick_sim(path: Path, tr, steady_s: float, model: str, gpu: str, kvb: float, pts: list[float],
               nodes: dict[str, int], session_rate: float) -> tuple[str, str]:
    """Quick pd vs CPD sweep on the trace (one seed, engine-object simulator); returns (figures, verdict)."""
    from cpd.sim.experiment import load_experiment
    from cpd.sim.sweep import run_sweep
    exp = copy.deepcopy(load_experiment("reference_b200"))
    exp.update(model=model, gpu=gpu, kv_dtype_bytes=kvb, steady_s=steady_s, ramp_s=10, drain_s=30)
    exp["workload"] = {"kind": "trace", "path": str(path), "spread_ticks": tr.format == "mooncake",
                       "max_idle_s": None if tr.timed else 60.0}
    exp["configs"] = {"pd": {}, "cpd-static": {},
                      "CPD-split": {"topology": "cpd", "pre_prefill": nodes["pre-prefill"],
                                    "prefill": nodes["prefill"], "decode": nodes["decode"]}}
    exp["qps_per_gpu"] = pts
    r = run_sweep(exp, progress=False, seeds=1)
    return quick_sim_verdict(r, pts)


def quick_sim_verdict(r: dict, pts: list[float]) -> tuple[str, str]:
    """Figures of a quick sweep and the verdict they support: "CPD pays" only when a CPD
    configuration's saturation load is bounded and above plain P/D's; "no supported verdict"
    when a saturation is not bounded by the simulated points (every point fails, or none does)."""
    s = r["saturation"]
    slo = r["slo"]

    def fig(c):
        x = s[c]
        if x["qps_per_gpu"] is None:
            return f"{c} fails the SLO at every point (first {x.get('first_fail')})"
        return f"{c} {x['qps_per_gpu']} QPS/GPU ({x['bounded']})"
    figs = (f"loads {pts} QPS/GPU; saturation (goodput >= {slo['goodput_min']} under TTFT <= {slo['ttft_s']} s and "
            f"TPOT <= {slo['tpot_s']} s): " + ", ".join(fig(c) for c in s))
    base = s["pd"]
    bounded = lambda x: x["qps_per_gpu"] is not None and x["bounded"] == "interpolated"
    cpd = [c for c in s if c != "pd" and bounded(s[c])]
    if not bounded(base) or not cpd:
        return figs, ("* **no supported verdict**: the simulated points do not bound the saturation of pd and a "
                      "CPD configuration (" + figs + "); rerun with other loads (`cpd simulate --trace`).")
    best = max(cpd, key=lambda c: s[c]["qps_per_gpu"])
    g = s[best]["qps_per_gpu"] / base["qps_per_gpu"] - 1
    if g > 0.05:
        return figs, f"* **CPD pays**: {best} sustains {s[best]['qps_per_gpu']} vs pd {base['qps_per_gpu']} QPS/GPU ({g * 100:+.0f} %)."
    return figs, (f"* **CPD does not pay here**: best CPD {best} {s[best]['qps_per_gpu']} vs pd "
                  f"{base['qps_per_gpu']} QPS/GPU ({g * 100:+.0f} %).")


def _uncached_section(sched, large: int, cost) -> list[str]:
    """Uncached tokens per request and the share of prefill work by request kind."""
    from cpd.analyze.stats import _pct
    from cpd.traces import KINDS
    unc = [q.uncached_trace_tokens for q in sched]
    tot = sum(unc) or 1
    work = {k: 0.0 for k in KINDS}
    tok = {k: 0 for k in KINDS}
    cnt = {k: 0 for k in KINDS}
    for q in sched:
        work[q.kind] += cost.prefill_time_s(q.uncached_trace_tokens, q.cached_trace_tokens)
        tok[q.kind] += q.uncached_trace_tokens
        cnt[q.kind] += 1
    wt = sum(work.values()) or 1.0
    big = [u for u in unc if u > large]
    L = ["", "## Uncached tokens per request (infinite cache)", "",
         f"* uncached tokens p50/p90/p99/max: {_pct(unc, .5):.0f} / {_pct(unc, .9):.0f} / {_pct(unc, .99):.0f} / {max(unc)}",
         f"* requests with more than {large} uncached tokens: {len(big) / len(unc) * 100:.1f} %, carrying "
         f"{sum(big) / tot * 100:.1f} % of all uncached tokens",
         "", f"Prefill work by request kind (warm_large: warm with > {large} uncached tokens; work = modeled "
         "prefill time of the uncached part on its cached prefix):", "",
         "| kind | requests | share of requests | share of uncached tokens | share of prefill work |", "|---|---:|---:|---:|---:|"]
    for k in KINDS:
        L.append(f"| {k} | {cnt[k]} | {cnt[k] / len(sched) * 100:.1f} % | {tok[k] / tot * 100:.1f} % | {work[k] / wt * 100:.1f} % |")
    return L


def _kind_plots(sched, out: Path, cost) -> None:
    """Uncached-token CDF, and each request kind's share of uncached tokens and of prefill work."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cpd.traces import KINDS
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    u = sorted(max(1, q.uncached_trace_tokens) for q in sched)
    ax[0].plot(u, [i / len(u) for i in range(len(u))])
    ax[0].set_xscale("log")
    ax[0].set_xlabel("uncached tokens per request")
    ax[0].set_ylabel("CDF")
    tok = [sum(q.uncached_trace_tokens for q in sched if q.kind == k) for k in KINDS]
    work = [sum(cost.prefill_time_s(q.uncached_trace_tokens, q.cached_trace_tokens) for q in sched if q.kind == k)
            for k in KINDS]
    x = range(len(KINDS))
    ax[1].bar([i - 0.2 for i in x], [t / max(1, sum(tok)) * 100 for t in tok], width=0.4, label="uncached tokens")
    ax[1].bar([i + 0.2 for i in x], [w / max(1e-12, sum(work)) * 100 for w in work], width=0.4, label="prefill work")
    ax[1].set_xticks(list(x), KINDS)
    ax[1].set_ylabel("% of all")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "uncached_cdf.png", dpi=100)
    plt.close(fig)


def _plots(prof, curve, out: Path, block_tokens: int = 512) -> None:
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
    ax.set_xlabel(f"LRU capacity ({block_tokens}-token blocks)")
    ax.set_ylabel("token hit ratio (%)")
    fig.tight_layout()
    fig.savefig(out / "lru_curve.png", dpi=100)
    plt.close(fig)


app = typer.Typer(add_completion=False)
app.command("analyze")(analyze)

if __name__ == "__main__":
    typer.run(analyze)
