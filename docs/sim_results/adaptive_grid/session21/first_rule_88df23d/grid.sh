#!/bin/bash
# session 21: adaptive cpd only, from a frozen snapshot of 88df23d (/tmp/snap21b); pd, pd-l3 and
# cpd-static of every cell from session 20's grid (6d3ad44: their code path is unchanged, checked in
# README.md), written into the repo's docs. $1: jobs (1 while the sensitivity study has the other core)
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
B=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap21b
PY=/work/main/.venv/bin/python
J=${1:-1}
cd $S
echo "88df23d (snapshot: git archive, run with PYTHONPATH=snapshot)" > $O/commit.txt
echo "agent start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --quick --cold 0,0.03,0.08,0.15 --ttft 0.5,1,2 --output 100,400 --seeds 3 --jobs $J --workloads agent --baselines-from $B/agent --out $O/agent >> $O/agent.log 2>&1
echo "mooncake start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --experiment docs/sim_results/adaptive_grid/decode2_short.experiment.json --seeds 3 --jobs $J --workloads mooncake --baselines-from $B/mooncake --out $O/mooncake > $O/mooncake.log 2>&1
echo "end $(date -u +%T)" >> $O/times_utc.txt
