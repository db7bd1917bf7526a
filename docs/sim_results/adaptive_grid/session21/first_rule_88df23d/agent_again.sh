#!/bin/bash
# session 21: the agent part of grid.sh again after its first process was killed by the kernel's OOM
# killer at the fourth cell (a test run beside it; its three finished cells are kept), once grid.sh
# (Mooncake) has ended
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
B=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap21b
PY=/work/main/.venv/bin/python
while pgrep -f "session21/grid.sh" > /dev/null; do sleep 5; done
cd $S
echo "agent again start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --quick --cold 0,0.03,0.08,0.15 --ttft 0.5,1,2 --output 100,400 --seeds 3 --jobs ${1:-1} --workloads agent --baselines-from $B/agent --out $O/agent >> $O/agent.log 2>&1
echo "agent again end $(date -u +%T)" >> $O/times_utc.txt
