#!/bin/bash
# session 21: the Claude Code cells with output 400 (never run on session 20's commit: all four
# configurations), one cell per call ($1: TTFT SLO), same snapshot as grid.sh (7c0c647)
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
S=/tmp/snap21e
PY=/work/main/.venv/bin/python
CC=docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json
cd $S
export PYTHONPATH=$S
echo "cc400 $1: start $(date -u +%T)" >> $O/times_utc.txt
nice -n 2 $PY benchmarks/adaptive_grid.py --seeds 3 --jobs 1 --experiment $CC --workloads claude-code --output 400 --ttft $1 --out $O/claude_code_400 >> $O/claude_code_400.log 2>&1
echo "cc400 $1: end $(date -u +%T)" >> $O/times_utc.txt
