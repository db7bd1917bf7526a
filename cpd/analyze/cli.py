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
   of it), and whether CPD pays against plain P/D on the simulated saturations below;
4. a recommendation (:mod:`cpd.analyze.deployment`): pools from the adaptive policy's classes and
   the role planner's rule, each configuration (pd, pd-l3, cpd-static, cpd, cpd-elastic) simulated
   on the trace with the saturation search of ``cpd simulate --compare`` under ``--ttft-slo-s`` /
   ``--tpot-slo-s``, the choice (or that it is not separated from the runner-up), and the exact
   ``cpd serve`` flags; also ``recommendation.json``.

Mountable: ``app.command("analyze")(analyze)``; also ``python -m cpd.analyze.cli TRACE``.
"""
from __future__ import annotations

import json
import math
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
    ttft_slo_s: float = typer.Option(1.0, "--ttft-slo-s", help="TTFT SLO of the recommendation (s)"),
    tpot_slo_s: float = typer.Option(0.05, "--tpot-slo-s", help="TPOT SLO of the recommendation (s)"),
    simulate: bool = typer.Option(True, help="simulate the configurations to choose one (see --sim-*)"),
    sim_seeds: int = typer.Option(1, "--sim-seeds", min=1, help="seeds per configuration (>= 2 gives intervals)"),
    sim_steady_s: float = typer.Option(20.0, "--sim-steady-s", help="steady window of each simulated point (s)"),
    sim_iters: int = typer.Option(2, "--sim-iters", min=0, help="bisection steps of each saturation search"),
    sim_loads: str = typer.Option("", "--sim-loads", help="starting QPS/GPU loads, comma-separated "
                                                          "(default: 0.5x and 1x the modeled capacity)"),
    sim_configs: str = typer.Option("pd,pd-l3,cpd-static,cpd,cpd-elastic", "--sim-configs",
                                    help="configurations to compare, comma-separated"),
    jobs: int = typer.Option(1, "--jobs", min=1, help="simulation processes (results do not depend on it)"),
    large_suffix_tokens: int = typer.Option(8192, help="warm requests with more uncached tokens are warm_large"),
    session_rate: float = typer.Option(0.05, help="Claude Code: Poisson session starts per second for reuse distance"),
) -> None:
    """Analyse a trace's prefix reuse, say whether cache-aware P/D (CPD) pays on it, and recommend
    a deployment (configuration, pools, `cpd serve` flags)."""
    from cpd.analyze.sessions import sessions_section
    from cpd.analyze.stats import capacity_for, reuse_profile
    from cpd.policy.cost_model import RooflineCostModel
    from cpd.sim.workload import schedule_to_sim
    from cpd.traces import ReplayOptions, Vocab, build_schedule, read_trace

    budget = _budget(ttft_slo_s, tpot_slo_s, sim_seeds, sim_steady_s, sim_iters, sim_loads, jobs)
    configs = _config_names(sim_configs)
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
    rec = _recommendation(trace, tr, reqs, prof, B, model, gpu, kv_dtype_bytes, tp, ttft_slo_s, tpot_slo_s,
                          total_gpus, configs, budget, simulate)
    if simulate:
        from cpd.analyze.recommend import cpd_verdict
        L.append(cpd_verdict(rec["configs"]))
    else:
        L.append("* **no supported verdict**: no simulation was run (--no-simulate); the queueing estimate above "
                 "is not one.")
    from cpd.analyze.deployment import markdown as rec_markdown
    L += rec_markdown(rec)
    (out / "recommendation.json").write_text(json.dumps(rec, sort_keys=True, indent=1) + "\n")
    _plots(prof, curve, out, B)
    _kind_plots(sched, out, cost)
    L += ["", "![reuse](reuse.png)", "", "![lru](lru_curve.png)", "", "![uncached](uncached_cdf.png)"]
    L += sessions_section(tr, out) + [""]
    text = "\n".join(L) + "\n"
    (out / "report.md").write_text(text)
    typer.echo(text)


def _budget(ttft_slo_s: float, tpot_slo_s: float, seeds: int, steady_s: float, iters: int, loads: str,
            jobs: int):
    """The SLOs checked (> 0, finite) and the simulation budget; a bad value is a usage error (exit 2)."""
    from cpd.analyze.deployment import SimBudget
    for name, v in (("--ttft-slo-s", ttft_slo_s), ("--tpot-slo-s", tpot_slo_s), ("--sim-steady-s", steady_s)):
        if not (math.isfinite(v) and v > 0):
            raise typer.BadParameter(f"must be a positive number of seconds, got {v:g}", param_hint=name)
    try:
        qs = tuple(float(x) for x in loads.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated QPS/GPU values, got {loads!r}",
                                 param_hint="--sim-loads") from None
    if any(not (math.isfinite(q) and q > 0) for q in qs):
        raise typer.BadParameter(f"loads must be positive, got {loads!r}", param_hint="--sim-loads")
    return SimBudget(seeds=seeds, steady_s=steady_s, iters=iters, loads=qs, jobs=jobs)


def _config_names(names: str) -> list[str]:
    from cpd.analyze.recommend import CONFIG_ORDER
    out = [c.strip() for c in names.split(",") if c.strip()]
    bad = [c for c in out if c not in CONFIG_ORDER]
    if bad or not out:
        raise typer.BadParameter(f"unknown {', '.join(bad) or 'empty list'} (known: {', '.join(CONFIG_ORDER)})",
                                 param_hint="--sim-configs")
    return out


def _recommendation(path: Path, tr, reqs, prof, block_tokens: int, model: str, gpu: str, kvb: float, tp: int,
                    ttft_slo_s: float, tpot_slo_s: float, total_gpus: int, configs: list[str], budget,
                    simulate: bool) -> dict:
    """:func:`cpd.analyze.deployment.recommend` on this trace (replayed as ``cpd simulate --trace``)."""
    from cpd.analyze.deployment import TooFewGpus, TraceInput, default_progress, experiment, recommend
    wl = {"kind": "trace", "path": str(path), "spread_ticks": tr.format == "mooncake",
          "max_idle_s": None if tr.timed else 60.0}
    t = TraceInput([r.arrival_s for r in reqs], [r.prompt_tokens for r in reqs], prof.cached_tokens,
                   [r.output_tokens for r in reqs], block_tokens, wl, timed=tr.timed)
    exp = experiment(model, gpu, kvb, tp, ttft_slo_s, tpot_slo_s, wl, budget)
    try:
        return recommend(exp, t, total_gpus, configs, budget, simulate, default_progress)
    except TooFewGpus as e:
        raise typer.BadParameter(str(e), param_hint="--total-gpus") from None


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
