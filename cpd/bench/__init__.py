"""``cpd bench``: open-loop trace replay against any OpenAI-compatible URL.

* :mod:`cpd.bench.trace` — Mooncake JSONL → token-id prompts (replay convention of
  ``shared/data/traces/README.md``), arrivals, trace-side reuse and warm/cold class.
* :mod:`cpd.bench.client` — async streaming replay over HTTP, per-request records.
* :mod:`cpd.bench.report` — summaries (TTFT/TPOT/ITL percentiles, goodput, cache hit), JSON,
  rich tables, comparison, plots.
* :mod:`cpd.bench.cli` — the typer app mounted as ``cpd bench``.
"""
