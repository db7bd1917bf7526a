#!/bin/bash
# session 20, after the agent part of grid.sh (whose process it waits for): Mooncake in full, then only
# the Claude Code cell TTFT 0.5 s / output 100 (the session's time did not allow all six: ~56 min)
O=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap20
PY=/work/main/.venv/bin/python
cd $S
while kill -0 "$1" 2>/dev/null; do sleep 5; done
echo "mooncake start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 19 $PY benchmarks/adaptive_grid.py --experiment docs/sim_results/adaptive_grid/decode2_short.experiment.json --seeds 3 --jobs 2 --workloads mooncake --out $O/mooncake > $O/mooncake.log 2>&1
echo "claude-code start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 19 $PY benchmarks/adaptive_grid.py --experiment docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json --seeds 3 --jobs 2 --workloads claude-code --ttft 0.5 --output 100 --out $O/claude_code > $O/claude_code.log 2>&1
echo "end $(date -u +%T)" >> $O/times_utc.txt
# then, by hand once the final test run had finished (23:48 UTC), two more Claude Code cells:
# PYTHONPATH=$S nice -n 19 $PY benchmarks/adaptive_grid.py --experiment docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json --seeds 3 --jobs 2 --workloads claude-code --ttft 1,2 --output 100 --out $O/claude_code_b > $O/claude_code_b.log 2>&1
