#!/bin/bash
# session 21, chain B (the other core): Mooncake, then the Claude Code cells with output 100 (adaptive
# cpd only, the others from session 20's two Claude Code runs, merged in /tmp/cc20), same snapshot
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
B=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap21d
PY=/work/main/.venv/bin/python
CC=docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json
mkdir -p /tmp/cc20/cells && cp $B/claude_code/cells/*.json $B/claude_code_b/cells/*.json /tmp/cc20/cells/
cd $S
echo "mooncake start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --experiment docs/sim_results/adaptive_grid/decode2_short.experiment.json --seeds 3 --jobs 1 --workloads mooncake --baselines-from $B/mooncake --out $O/mooncake > $O/mooncake.log 2>&1
echo "claude-code start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --experiment $CC --seeds 3 --jobs 1 --workloads claude-code --output 100 --baselines-from /tmp/cc20 --out $O/claude_code > $O/claude_code.log 2>&1
echo "chain B end $(date -u +%T)" >> $O/times_utc.txt
