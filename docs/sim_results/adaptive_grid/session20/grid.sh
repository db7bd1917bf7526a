#!/bin/bash
# runs the grid from a frozen snapshot of 6d3ad44 (/tmp/snap20), writing into the repo's docs
O=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap20
PY=/work/main/.venv/bin/python
cd $S
echo "6d3ad44 (snapshot: git archive, run with PYTHONPATH=snapshot)" > $O/commit.txt
echo "agent start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 19 $PY benchmarks/adaptive_grid.py --quick --cold 0,0.03,0.08,0.15 --ttft 0.5,1,2 --output 100,400 --seeds 3 --jobs 2 --workloads agent --out $O/agent >> $O/agent.log 2>&1
echo "mooncake start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 19 $PY benchmarks/adaptive_grid.py --experiment docs/sim_results/adaptive_grid/decode2_short.experiment.json --seeds 3 --jobs 2 --workloads mooncake --out $O/mooncake > $O/mooncake.log 2>&1
echo "claude-code start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 19 $PY benchmarks/adaptive_grid.py --experiment docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json --seeds 3 --jobs 2 --workloads claude-code --out $O/claude_code > $O/claude_code.log 2>&1
echo "end $(date -u +%T)" >> $O/times_utc.txt
