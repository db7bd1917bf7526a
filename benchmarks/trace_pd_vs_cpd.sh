#!/usr/bin/env bash
# Replay the same slice of the Mooncake conversation trace against `cpd serve --topology pd`
# and `--topology cpd` (same number of workers), one after the other, and compare.
#
#   benchmarks/trace_pd_vs_cpd.sh [OUT_DIR]
#
# Knobs (environment): REQUESTS=300 TPH=16 TIME_SCALE=0.2 MAX_OUT=32 PORT=8031 KV_STORE=""
# For each topology OUT_DIR gets: <topo>.json (cpd bench results), <topo>.metrics (router
# Prometheus text at the end), <topo>.workers.json (worker load/pool figures), <topo>.mem
# (each worker's peak RSS, VmHWM), plus compare.png.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/trace_pd_vs_cpd}
REQUESTS=${REQUESTS:-300} TPH=${TPH:-16} TIME_SCALE=${TIME_SCALE:-0.2} MAX_OUT=${MAX_OUT:-32}
PORT=${PORT:-8031} KV_STORE=${KV_STORE:-}
TRACE=../shared/data/traces/mooncake/conversation_trace.jsonl
mkdir -p "$OUT"
for topo in pd cpd; do
  if [ "$topo" = pd ]; then pools="--prefill 2 --decode 1"; else pools="--pre-prefill 1 --prefill 1 --decode 1"; fi
  .venv/bin/cpd serve --topology "$topo" $pools --port "$PORT" ${KV_STORE:+--kv-store "$KV_STORE"} \
      --log-dir "$OUT/$topo-logs" > "$OUT/$topo.serve.log" 2>&1 &
  serve=$!
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then echo "port $PORT already serves" >&2; exit 1; fi
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  .venv/bin/cpd bench --url "http://127.0.0.1:$PORT" --trace "$TRACE" --max-requests "$REQUESTS" \
      --tokens-per-hash-id "$TPH" --time-scale "$TIME_SCALE" --max-output-tokens "$MAX_OUT" \
      --label "$topo" --out "$OUT/$topo.json" --plot "$OUT/$topo.ttft_cdf.png" | tee "$OUT/$topo.bench.txt"
  curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/$topo.metrics"
  curl -s "http://127.0.0.1:$PORT/cpd/workers" > "$OUT/$topo.workers.json"
  for pid in $(pgrep -f "cpd.worker.main" || true); do
    echo "$(tr '\0' ' ' < /proc/$pid/cmdline | grep -o -- '--worker-id [^ ]*') $(grep VmHWM /proc/$pid/status)"
  done > "$OUT/$topo.mem"
  kill -TERM "$serve"; wait "$serve" || true
done
.venv/bin/cpd bench compare "$OUT/pd.json" "$OUT/cpd.json" --plot "$OUT/compare.png" | tee "$OUT/compare.txt"
