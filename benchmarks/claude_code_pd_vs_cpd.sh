#!/usr/bin/env bash
# Replay real Claude Code sessions against `cpd serve --topology pd` and `--topology cpd` (same
# number of workers: 3), one after the other, with the real model, and compare per request kind.
#
#   benchmarks/claude_code_pd_vs_cpd.sh [OUT_DIR]
#
# Shrunk for a 2-core CPU machine (knobs in the environment): USERS=3 closed-loop users, the first
# SESSIONS=3 conversations, MAX_REQUESTS=40 first requests of each, TPB=2 replayed tokens per 64-token
# trace block (a 100K-token prompt becomes ~3.2K tokens), MAX_CONTEXT=98304 trace tokens (= 3072
# replayed: --max-context counts the trace's tokens), MAX_OUT=8 output tokens,
# MAX_IDLE_S=2 (think times capped), SHARED=1.0 (tool definitions + system prompt shared by all
# sessions), SLO_TTFT_S=2. Each topology gets a fresh deployment (empty caches).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/claude_code_pd_vs_cpd}
USERS=${USERS:-3} SESSIONS=${SESSIONS:-3} MAX_REQUESTS=${MAX_REQUESTS:-40} TPB=${TPB:-2}
MAX_CONTEXT=${MAX_CONTEXT:-98304} MAX_OUT=${MAX_OUT:-8} MAX_IDLE_S=${MAX_IDLE_S:-2} SHARED=${SHARED:-1.0}
SLO_TTFT_S=${SLO_TTFT_S:-2} PORT=${PORT:-8033}
TRACE=../shared/data/traces/claude_code
mkdir -p "$OUT"
for topo in pd cpd; do
  if [ "$topo" = pd ]; then pools="--prefill 2 --decode 1"; else pools="--pre-prefill 1 --prefill 1 --decode 1"; fi
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then echo "port $PORT already serves" >&2; exit 1; fi
  .venv/bin/cpd serve --topology "$topo" $pools --port "$PORT" --log-dir "$OUT/$topo-logs" > "$OUT/$topo.serve.log" 2>&1 &
  serve=$!
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  .venv/bin/cpd bench --url "http://127.0.0.1:$PORT" --trace "$TRACE" --users "$USERS" --max-sessions "$SESSIONS" \
      --max-requests "$MAX_REQUESTS" --tokens-per-block "$TPB" --max-context "$MAX_CONTEXT" \
      --max-output-tokens "$MAX_OUT" --max-idle-s "$MAX_IDLE_S" --shared-prefix-fraction "$SHARED" \
      --slo-ttft-s "$SLO_TTFT_S" --label "$topo" --out "$OUT/$topo.json" | tee "$OUT/$topo.bench.txt"
  curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/$topo.metrics"
  kill -INT "$serve"; wait "$serve" || true
done
.venv/bin/cpd bench compare "$OUT/pd.json" "$OUT/cpd.json" --plot "$OUT/compare.png" | tee "$OUT/compare.txt"
