"""``cpd bench``: replay a Mooncake trace against any OpenAI-compatible URL; compare results.

Usage::

    cpd bench --url http://127.0.0.1:8000 --trace conversation_trace.jsonl \\
        --tokens-per-hash-id 16 --time-scale 0.5 --max-requests 200 --out pd.json --label pd
    cpd bench run --url ...            # same as above
    cpd bench compare pd.json cpd.json --plot ttft.png

The main ``cpd`` CLI mounts ``app`` with ``app.add_typer(bench.cli.app, name="bench")``; it also
runs standalone as ``python -m cpd.bench.cli``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

app = typer.Typer(help="Load generator: replay a Mooncake trace against an OpenAI-compatible URL.",
                  no_args_is_help=False, add_completion=False)


def _parse_ids(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token ids, got {text!r}",
                                 param_hint="--special-ids") from None


def resolve_vocab(card: dict[str, Any], *, tokenizer: str | None, vocab_size: int | None,
                  special_ids: str | None):
    """Vocabulary for prompt drawing: ``--vocab-size`` (+ ``--special-ids``) if given, else
    ``--tokenizer``, else the server's model card (``vocab_size`` / ``special_token_ids``), else a
    local tokenizer directory named by the card's ``root`` or ``id``. Raises
    ``typer.BadParameter`` if none applies."""
    from .trace import Vocab, vocab_from_model_card, vocab_from_tokenizer

    if vocab_size is not None:
        return Vocab(vocab_size, _parse_ids(special_ids), source="cli")
    if tokenizer:
        tv = vocab_from_tokenizer(tokenizer)
        extra = _parse_ids(special_ids)
        return Vocab(tv.size, tuple(sorted(set(tv.special_ids) | set(extra))), tv.source) if extra else tv
    v = vocab_from_model_card(card)
    if v is None:
        # a server on this machine may name its model by its directory (cpd serve does)
        local = next((str(card[k]) for k in ("root", "id") if isinstance(card.get(k), str)
                      and (Path(card[k]) / "tokenizer_config.json").is_file()), None)
        if local is not None:
            v = vocab_from_tokenizer(local)
    if v is None:
        raise typer.BadParameter(
            "the server's model card has no vocab_size; pass --tokenizer DIR or --vocab-size N "
            "[--special-ids 0,1,2]", param_hint="--tokenizer/--vocab-size")
    extra = _parse_ids(special_ids)
    return type(v)(v.size, tuple(sorted(set(v.special_ids) | set(extra))), v.source) if extra else v


def _server_card(url: str, model: str | None, api_key: str | None) -> dict[str, Any]:
    """The served model's card from ``GET {url}/v1/models``; a server that cannot be reached, refuses
    the key or answers something else is a clear ``--url`` error, not a traceback."""
    import httpx

    from . import client as bc

    try:
        return bc.pick_model(bc.fetch_models(url, api_key=api_key), model)
    except (httpx.HTTPError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise typer.BadParameter(f"{url}/v1/models: {type(e).__name__}: {e}", param_hint="--url") from None


def run_bench(*, url: str, trace: Path, model: Optional[str] = None, tokens_per_hash_id: Optional[int] = None,
              time_scale: float = 1.0, max_requests: Optional[int] = None, start: int = 0, seed: int = 0,
              max_prompt_tokens: Optional[int] = None, max_output_tokens: Optional[int] = None,
              spread_ticks: bool = False,
              max_concurrency: Optional[int] = None, timeout_s: float = 600.0,
              slo_ttft_s: Optional[float] = None, slo_tpot_s: Optional[float] = None,
              out: Optional[Path] = None, plot: Optional[Path] = None, label: Optional[str] = None,
              tokenizer: Optional[str] = None, vocab_size: Optional[int] = None,
              special_ids: Optional[str] = None, warm_threshold: float = 0.5,
              context_len: Optional[int] = None, api_key: Optional[str] = None,
              users: Optional[int] = None, session_rate: Optional[float] = None,
              shared_prefix_fraction: float = 0.0, max_context: Optional[int] = None,
              max_sessions: Optional[int] = None, max_idle_s: Optional[float] = None,
              large_suffix_tokens: int = 8192, collapse_pairs: bool = False, azure_prefix_tokens: int = 0,
              quiet: bool = False, console: Any = None, time_dilation: float = 1.0) -> dict[str, Any]:
    """Whole ``cpd bench run`` flow; returns ``{"config", "summary", "records"}``.

    Resolves the model (``GET /v1/models``) and vocabulary, converts the trace (prompts capped at
    ``context_len - output_length``; ``context_len`` defaults to the card's ``max_model_len``, 0
    disables the cap), replays it (``time_dilation`` K: arrivals K× slower and every reported time
    divided by K, for a modeled deployment run with ``--time-dilation K``), prints
    the summary table, writes ``out`` (JSON) and ``plot`` (TTFT CDF PNG) if given.
    """
    from rich.console import Console

    from cpd.traces import ReplayOptions, build_schedule, options_record, read_trace

    from . import client as bc
    from . import report

    console = console or Console()
    try:
        tr = read_trace(trace)
    except ValueError as e:  # TraceFormatError: file, line, what was expected
        raise typer.BadParameter(str(e), param_hint="--trace") from None
    card = _server_card(url, model, api_key)
    vocab = resolve_vocab(card, tokenizer=tokenizer, vocab_size=vocab_size, special_ids=special_ids)
    if context_len is None and isinstance(card.get("max_model_len"), int):
        context_len = card["max_model_len"]
    if context_len is not None and context_len <= 0:
        context_len = None  # --context-len 0: no context cap
    opts = ReplayOptions(tokens_per_block=tokens_per_hash_id, seed=seed, time_scale=time_scale / time_dilation,
                         spread_ticks=spread_ticks, users=users, session_rate=session_rate,
                         shared_prefix_fraction=shared_prefix_fraction, azure_prefix_tokens=azure_prefix_tokens,
                         max_context=max_context, max_prompt_tokens=max_prompt_tokens, context_len=context_len,
                         max_output_tokens=max_output_tokens, cold_threshold=warm_threshold,
                         large_suffix_tokens=large_suffix_tokens, collapse_pairs=collapse_pairs, start=start,
                         max_requests=max_requests, max_sessions=max_sessions, max_idle_s=max_idle_s)
    try:
        reqs = build_schedule(tr, opts, vocab)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if not quiet:
        last = max((r.arrival_s for r in reqs), default=0.0)
        console.print(f"[bold]cpd bench[/]: {len(reqs)} requests ({tr.format}, {opts.arrival_model(tr)}; "
                      f"last scheduled arrival {last:.1f}s) to {url} "
                      f"(model {card['id']}, vocab {vocab.size} from {vocab.source})")
    done = [0]

    def on_done(_rec):
        done[0] += 1
        if not quiet and (done[0] % max(1, len(reqs) // 10) == 0 or done[0] == len(reqs)):
            console.print(f"  {done[0]}/{len(reqs)} done")

    res = bc.run_replay(url, reqs, model=card["id"], max_concurrency=max_concurrency, timeout_s=timeout_s,
                        api_key=api_key, on_done=on_done)
    from .dilation import undilate
    records = undilate(res.records, time_dilation)
    summary = report.summarize(records, res.duration_s / time_dilation, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    config = {"label": label, "url": url, "model": res.model, "started_at": res.started_at,
              "max_concurrency": max_concurrency, "timeout_s": timeout_s,
              "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s,
              "arrival_mode": "spread_ticks" if spread_ticks else "bursty_ticks",
              "special_ids": list(vocab.special_ids), "tokens_per_hash_id": tokens_per_hash_id,
              "warm_threshold": warm_threshold, "time_dilation": time_dilation, **options_record(tr, opts, vocab)}
    if not quiet:
        report.print_summary(summary, console, title=f"cpd bench {label or ''}".strip())
    if out is not None:
        report.write_results(out, config, summary, records)
        if not quiet:
            console.print(f"wrote {out}")
    if plot is not None:
        report.plot_ttft_cdf(records, plot, title=f"TTFT CDF {label or ''}".strip())
    return {"config": config, "summary": summary, "records": records}


def _bench(
    ctx: typer.Context,
    url: Optional[str] = typer.Option(None, "--url", help="server base URL, e.g. http://127.0.0.1:8000"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="trace: Mooncake JSONL, Claude Code folder/file, Azure CSV"),
    model: Optional[str] = typer.Option(None, "--model", help="model name (default: first of /v1/models)"),
    tokens_per_hash_id: Optional[int] = typer.Option(None, "--tokens-per-block", "--tokens-per-hash-id", min=1,
                                                     max=512, help="replayed tokens per trace block (shrink for CPU runs)"),
    time_scale: float = typer.Option(1.0, "--time-scale", help=">1 compresses time (more load)"),
    time_dilation: float = typer.Option(1.0, "--time-dilation", min=1e-9,
                                        help="the deployment's --time-dilation K: replay K× slower, report times / K"),
    max_requests: Optional[int] = typer.Option(None, "--max-requests", min=1,
                                               help="timed traces: requests in all; Claude Code: the first N of each session"),
    start: int = typer.Option(0, "--start", min=0, help="first trace row to replay"),
    seed: int = typer.Option(0, "--seed", min=0),
    max_prompt_tokens: Optional[int] = typer.Option(None, "--max-prompt-tokens", min=1,
                                                    help="drop whole trailing blocks beyond this"),
    max_output_tokens: Optional[int] = typer.Option(None, "--max-output-tokens", min=1,
                                                    help="cap max_tokens below the trace's output_length"),
    spread_ticks: bool = typer.Option(False, "--spread-ticks/--bursty-ticks",
                                      help="spread each 3 s trace tick uniformly"),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", min=1),
    timeout_s: float = typer.Option(600.0, "--timeout-s", min=1e-3, help="per-request total timeout"),
    slo_ttft_s: Optional[float] = typer.Option(None, "--slo-ttft-s"),
    slo_tpot_s: Optional[float] = typer.Option(None, "--slo-tpot-s"),
    out: Optional[Path] = typer.Option(None, "--out", help="results JSON path"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="TTFT CDF PNG path"),
    label: Optional[str] = typer.Option(None, "--label", help="name of this run in compare"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="HF tokenizer dir for vocab/special ids"),
    vocab_size: Optional[int] = typer.Option(None, "--vocab-size", min=1),
    special_ids: Optional[str] = typer.Option(None, "--special-ids", help="comma-separated ids never drawn"),
    warm_threshold: float = typer.Option(0.5, "--warm-threshold", min=0.0, max=1.0,
                                         help="trace reuse >= this is warm"),
    context_len: Optional[int] = typer.Option(None, "--context-len", min=0,
                                              help="cap prompt+output (default: server max_model_len; 0: off)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="CPD_BENCH_API_KEY"),
    users: Optional[int] = typer.Option(None, "--users", min=1,
                                        help="Claude Code: closed loop, N users replaying sessions back to back"),
    session_rate: Optional[float] = typer.Option(None, "--session-rate",
                                                 help="Claude Code: open loop, Poisson session starts per second"),
    shared_prefix_fraction: float = typer.Option(0.0, "--shared-prefix-fraction", min=0.0, max=1.0,
                                                 help="map this fraction of the tool+system blocks to one shared prefix"),
    max_context: Optional[int] = typer.Option(None, "--max-context", min=1,
                                              help="truncate prompts to whole blocks within this many trace tokens"),
    max_sessions: Optional[int] = typer.Option(None, "--max-sessions", min=1, help="replay the first N sessions"),
    max_idle_s: Optional[float] = typer.Option(None, "--max-idle-s", min=0.0,
                                               help="cap every pause inside a session (trace seconds)"),
    large_suffix_tokens: int = typer.Option(8192, "--large-suffix-tokens",
                                            help="warm requests with more uncached trace tokens are warm_large"),
    collapse_pairs: bool = typer.Option(False, "--collapse-pairs", help="send an s/n pair with equal hash_ids once"),
    azure_prefix_tokens: int = typer.Option(0, "--azure-prefix-tokens",
                                            help="Azure CSV (no prefix info): model a shared prefix of N tokens"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress or table output"),
) -> None:
    """Replay a trace (``cpd bench --url U --trace F`` or ``cpd bench run ...``)."""
    if ctx.invoked_subcommand is not None:
        return
    if url is None or trace is None:
        typer.echo(ctx.get_help())
        raise typer.Exit(2)
    result = run_bench(url=url, trace=trace, model=model, tokens_per_hash_id=tokens_per_hash_id,
                       time_scale=time_scale, time_dilation=time_dilation, max_requests=max_requests, start=start, seed=seed,
                       max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
                       spread_ticks=spread_ticks,
                       max_concurrency=max_concurrency, timeout_s=timeout_s, slo_ttft_s=slo_ttft_s,
                       slo_tpot_s=slo_tpot_s, out=out, plot=plot, label=label, tokenizer=tokenizer,
                       vocab_size=vocab_size, special_ids=special_ids, warm_threshold=warm_threshold,
                       context_len=context_len, api_key=api_key, users=users, session_rate=session_rate,
                       shared_prefix_fraction=shared_prefix_fraction, max_context=max_context,
                       max_sessions=max_sessions, max_idle_s=max_idle_s, large_suffix_tokens=large_suffix_tokens,
                       collapse_pairs=collapse_pairs, azure_prefix_tokens=azure_prefix_tokens, quiet=quiet)
    if result["summary"]["ok"] == 0 and result["summary"]["n"] > 0:
        raise typer.Exit(1)


app.callback(invoke_without_command=True)(_bench)
app.command("run")(_bench)


@app.command("compare")
def compare_cmd(files: List[Path] = typer.Argument(..., exists=True, dir_okay=False, help="results JSON files"),
                plot: Optional[Path] = typer.Option(None, "--plot", help="p50/p90 TTFT bar chart PNG"),
                as_json: bool = typer.Option(False, "--json", help="also print summaries as JSON")) -> None:
    """Print results side by side (e.g. ``pd`` vs ``cpd``)."""
    from .report import compare

    try:
        docs = compare(files, plot=plot)
    except ValueError as e:  # load_results: which file is not a results file, and why
        raise typer.BadParameter(str(e), param_hint="FILES") from None
    if as_json:
        typer.echo(json.dumps({d["label"]: d["summary"] for d in docs}, indent=1))


if __name__ == "__main__":
    app()
