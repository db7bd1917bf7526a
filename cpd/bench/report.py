"""Bench summaries, JSON results, rich tables, side-by-side comparison and plots.

Results JSON (``write_results``)::

    {"version": 1, "config": {...}, "summary": {...}, "records": [RequestRecord dicts]}

Summary fields (times in seconds): ``n``, ``ok``, ``errors``, ``error_kinds``, ``duration_s``,
``request_throughput`` (successful requests/s), ``output_throughput`` (output tokens/s),
``goodput`` (requests/s meeting both SLOs; None without an SLO), ``slo``, ``cache_hit_ratio``
(server-side: sum cached_tokens / sum prompt_tokens over requests reporting usage; None if none
does), ``trace_reuse`` (mean per-request trace reuse), ``classes`` (request counts per trace
class), and per group ``all`` / ``warm`` / ``cold``: ``ttft`` and ``tpot`` stats
(``n, mean, p50, p90, p99``), ``e2e`` stats, ``itl`` (``n, p50, p99`` over all gaps pooled).
Percentiles use linear interpolation (numpy default) over successful requests only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .client import RequestRecord

GROUPS = ("all", "warm", "cold")
#: Request kinds of session traces (``cpd.traces.replay``): cold, warm with a small / large
#: uncached suffix (threshold ``large_suffix_tokens``, 8192 trace tokens by default), subagent.
KIND_GROUPS = ("cold", "warm_small", "warm_large", "subagent")


def stats(values: Iterable[float | None], pcts: Sequence[int] = (50, 90, 99)) -> dict[str, Any]:
    """``{"n", "mean", "p50", "p90", "p99"}`` of the non-None ``values`` (all None when empty)."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    out: dict[str, Any] = {"n": int(arr.size), "mean": float(arr.mean()) if arr.size else None}
    for p in pcts:
        out[f"p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def _group(records: Sequence[RequestRecord], g: str) -> list[RequestRecord]:
    return [r for r in records if g == "all" or r.trace_class == g]


def _error_kind(err: str) -> str:
    if err.startswith("HTTP "):
        return err.split(":", 1)[0]
    if err.startswith("timeout"):
        return "timeout"
    return err.split(":", 1)[0]


def meets_slo(r: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """True if ``r`` succeeded, its TTFT <= ``slo_ttft_s`` and its TPOT <= ``slo_tpot_s``.

    A None bound is not checked; a request with fewer than 2 output tokens has no TPOT and passes
    the TPOT bound; a successful request without a first token fails the TTFT bound.
    """
    if not r.ok:
        return False
    if slo_ttft_s is not None and (r.ttft_s is None or r.ttft_s > slo_ttft_s):
        return False
    if slo_tpot_s is not None and r.tpot_s is not None and r.tpot_s > slo_tpot_s:
        return False
    return True


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None, *,
              slo_ttft_s: float | None = None, slo_tpot_s: float | None = None) -> dict[str, Any]:
    """Summary dict of a replay (see module docstring).

    ``duration_s`` defaults to (last finish − first send) from the records' ``send_s`` / ``e2e_s``.
    """
    ok = [r for r in records if r.ok]
    if duration_s is None:
        sent = [(r.send_s, r.e2e_s or 0.0) for r in records if r.send_s is not None]
        duration_s = (max(s + e for s, e in sent) - min(s for s, _ in sent)) if sent else 0.0
    dur = duration_s if duration_s and duration_s > 0 else None
    kinds: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            k = _error_kind(r.error)
            kinds[k] = kinds.get(k, 0) + 1
    usage = [r for r in records if r.prompt_tokens]
    prompt_sum = sum(r.prompt_tokens or 0 for r in usage)
    cached_sum = sum(r.cached_tokens or 0 for r in usage)
    has_slo = slo_ttft_s is not None or slo_tpot_s is not None
    good = sum(1 for r in records if meets_slo(r, slo_ttft_s, slo_tpot_s)) if has_slo else None
    out: dict[str, Any] = {
        "n": len(records), "ok": len(ok), "errors": len(records) - len(ok), "error_kinds": kinds,
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur if dur else None,
        "output_throughput": sum(r.output_tokens for r in ok) / dur if dur else None,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "goodput": (good / dur if dur else None) if good is not None else None,
        "slo_met": good,
        "cache_hit_ratio": cached_sum / prompt_sum if prompt_sum else None,
        "prompt_tokens": prompt_sum, "cached_tokens": cached_sum,
        "trace_reuse": float(np.mean([r.reuse for r in records])) if records else None,
        "classes": {g: len(_group(records, g)) for g in GROUPS},
        "sched_lag_p99_s": stats((r.sched_lag_s for r in records), (99,))["p99"],
    }
    for g in GROUPS:
        out[g] = _group_stats([r for r in _group(records, g) if r.ok])
    by_kind = {}
    for k in KIND_GROUPS:
        rs = [r for r in records if r.kind == k]
        if rs:
            good_k = sum(1 for r in rs if meets_slo(r, slo_ttft_s, slo_tpot_s)) if has_slo else None
            by_kind[k] = {**_group_stats([r for r in rs if r.ok]), "requests": len(rs),
                          "errors": sum(1 for r in rs if not r.ok), "slo_met": good_k,
                          "goodput": (good_k / dur if dur else None) if good_k is not None else None,
                          "uncached_trace_tokens": sum(r.uncached_trace_tokens for r in rs)}
    out["kinds"] = by_kind
    return out


def _group_stats(rs: Sequence[RequestRecord]) -> dict[str, Any]:
    itl = stats((x for r in rs for x in r.itls_s), (50, 99))
    return {"n": len(rs), "ttft": stats(r.ttft_s for r in rs), "tpot": stats(r.tpot_s for r in rs),
            "e2e": stats(r.e2e_s for r in rs), "itl": {"n": itl["n"], "p50": itl["p50"], "p99": itl["p99"]}}


def write_results(path: str | Path, config: dict[str, Any], summary: dict[str, Any],
                  records: Sequence[RequestRecord]) -> None:
    """Write ``{"version", "config", "summary", "records"}`` as JSON to ``path``."""
    head = json.dumps({"version": 1, "config": config, "summary": summary}, indent=1)
    body = ",\n".join(json.dumps(r.to_dict(), separators=(",", ":")) for r in records)  # one record a line
    Path(path).write_text(head[:-2] + ',\n "records": [\n' + body + "\n ]\n}\n", encoding="utf-8")


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a results JSON; ``records`` become ``RequestRecord`` objects; adds ``label`` (the
    config's ``label`` or the file stem). Raises ``ValueError`` naming the file if it is not a
    results file (not JSON, truncated, or without the summary and records ``cpd bench`` writes)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
            raise ValueError("no summary object")
        _rows(doc["summary"])  # every figure compare prints is there
        doc["records"] = [RequestRecord.from_dict(d) for d in doc.get("records", [])]
        doc["label"] = (doc.get("config") or {}).get("label") or Path(path).stem
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not a cpd bench results file ({type(e).__name__}: {e})") from None
    return doc


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("requests (ok / errors)", f"{s['ok']} / {s['errors']}"),
            ("warm / cold (trace class)", f"{s['classes']['warm']} / {s['classes']['cold']}"),
            ("duration s", _num(s["duration_s"], "{:.2f}")),
            ("throughput req/s", _num(s["request_throughput"])),
            ("output tok/s", _num(s["output_throughput"], "{:.1f}")),
            ("goodput req/s", _num(s.get("goodput"))),
            ("server cache hit", _num(s.get("cache_hit_ratio"), "{:.1%}")),
            ("trace reuse (mean)", _num(s.get("trace_reuse"), "{:.1%}"))]
    for g in GROUPS:
        for m in ("ttft", "tpot"):
            st = s[g][m]
            rows.append((f"{m.upper()} ms {g} mean/p50/p90/p99",
                         " / ".join(_ms(st[k]) for k in ("mean", "p50", "p90", "p99"))))
    rows.append(("ITL ms p50/p99", f"{_ms(s['all']['itl']['p50'])} / {_ms(s['all']['itl']['p99'])}"))
    for k, ks in (s.get("kinds") or {}).items():
        for m in ("ttft", "tpot"):
            st = ks[m]
            rows.append((f"{m.upper()} ms {k} (n={ks['requests']}) p50/p90/p99",
                         " / ".join(_ms(st[q]) for q in ("p50", "p90", "p99"))))
        if ks.get("goodput") is not None:
            rows.append((f"goodput req/s {k}", _num(ks["goodput"])))
    return rows


def print_summary(summary: dict[str, Any], console: Any = None, title: str = "cpd bench") -> None:
    """Print ``summary`` as a rich table (to ``console``, default a new ``rich.console.Console``)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=title)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in _rows(summary):
        t.add_row(k, v)
    console.print(t)
    if summary.get("error_kinds"):
        console.print("errors: " + ", ".join(f"{k} ×{v}" for k, v in summary["error_kinds"].items()))


def compare(paths: Sequence[str | Path], *, plot: str | Path | None = None, console: Any = None) -> list[dict[str, Any]]:
    """Load results files, print their summaries side by side, optionally plot TTFT bars.

    Returns the loaded documents (see ``load_results``). ``plot``: PNG path for ``plot_compare``.
    """
    from rich.console import Console
    from rich.table import Table

    docs = [load_results(p) for p in paths]
    console = console or Console()
    t = Table(title="cpd bench compare")
    t.add_column("metric")
    for d in docs:
        t.add_column(str(d["label"]), justify="right")
    per = [dict(_rows(d["summary"])) for d in docs]
    for k in per[0] if per else []:
        t.add_row(k, *[p.get(k, "-") for p in per])
    console.print(t)
    if plot is not None:
        plot_compare(docs, plot)
    return docs


def plot_ttft_cdf(records: Sequence[RequestRecord], path: str | Path, title: str = "TTFT CDF") -> None:
    """Write a PNG with the empirical TTFT CDF (seconds) of successful warm and cold requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lo, hi = np.inf, 0.0
    for g in ("warm", "cold"):
        v = np.sort([r.ttft_s for r in records if r.ok and r.trace_class == g and r.ttft_s is not None])
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{g} (n={v.size})")
            lo, hi = min(lo, float(v[0])), max(hi, float(v[-1]))
    if 0 < lo and hi / lo > 100:
        ax.set_xscale("log")  # long tails: keep the body of the distribution readable
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_compare(docs: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Write a PNG bar chart of p50 and p90 TTFT (s) per label, one panel per group all/warm/cold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(GROUPS), figsize=(4 * len(GROUPS), 4), sharey=True)
    x = np.arange(len(docs))
    for ax, g in zip(axes, GROUPS):
        for j, p in enumerate(("p50", "p90")):
            vals = [d["summary"][g]["ttft"][p] or 0.0 for d in docs]
            ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, label=f"{p} TTFT")
        ax.set_xticks(x, [str(d["label"]) for d in docs])
        ax.set_title(g)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("TTFT (s)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["GROUPS", "stats", "meets_slo", "summarize", "write_results", "load_results",
           "print_summary", "compare", "plot_ttft_cdf", "plot_compare"]
