#!/bin/bash
# session 21: chain a's agent cells again (its process was OOM-killed at its fifth cell beside chain b's
# agent process; the four finished cells are kept), once chain a (Mooncake) has ended; then the
# baseline identity check; then the full agent grid.json from the cells (no new search)
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
B=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap21e
PY=/work/main/.venv/bin/python
while pgrep -f "grid.sh a" > /dev/null; do sleep 5; done
cd $S
export PYTHONPATH=$S
echo "a2: agent start $(date -u +%T)" >> $O/times_utc.txt
nice -n 2 $PY benchmarks/adaptive_grid.py --seeds 3 --jobs 1 --quick --cold 0,0.03 --ttft 0.5,1,2 --output 100,400 --workloads agent --baselines-from $B/agent --out $O/agent >> $O/agent_a.log 2>&1
echo "a2: check start $(date -u +%T)" >> $O/times_utc.txt
nice -n 2 $PY $O/check_baselines.py $O/check_baselines.jsonl > $O/check_baselines.log 2>&1
nice -n 2 $PY benchmarks/adaptive_grid.py --seeds 3 --jobs 1 --quick --cold 0,0.03,0.08,0.15 --ttft 0.5,1,2 --output 100,400 --workloads agent --baselines-from $B/agent --out $O/agent > $O/agent_all.log 2>&1
echo "a2: end $(date -u +%T)" >> $O/times_utc.txt
