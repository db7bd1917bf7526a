#!/bin/bash
# session 21, chain A (one core): the agent grid, adaptive cpd only, from a frozen snapshot of 977632c
# (/tmp/snap21d); pd, pd-l3 and cpd-static of every cell from session 20's grid (6d3ad44: their code
# path is unchanged, checked by check_baselines.py at the end)
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
B=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap21d
PY=/work/main/.venv/bin/python
cd $S
echo "977632c (snapshot: git archive, run with PYTHONPATH=snapshot)" > $O/commit.txt
echo "agent start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --quick --cold 0,0.03,0.08,0.15 --ttft 0.5,1,2 --output 100,400 --seeds 3 --jobs 1 --workloads agent --baselines-from $B/agent --out $O/agent >> $O/agent.log 2>&1
echo "check start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY $O/check_baselines.py $O/check_baselines.jsonl > $O/check_baselines.log 2>&1
echo "chain A end $(date -u +%T)" >> $O/times_utc.txt
