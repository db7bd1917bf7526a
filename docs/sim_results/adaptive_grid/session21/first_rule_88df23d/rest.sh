#!/bin/bash
# session 21, after agent_again.sh and the static-configuration sensitivity study have ended:
# the Claude Code cells (output 100: cpd only, baselines from session 20's two runs; output 400: all
# four, never run on session 20's commit), the baseline identity check, then (snapshot of ac77d92:
# the same routing code as 88df23d but for a rename and docstrings) the sensitivity study's cpd
# column on the static study's rows
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
S=/tmp/snap21b
S2=/tmp/snap21c
PY=/work/main/.venv/bin/python
CC=docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json
while pgrep -f "agent_again.sh" > /dev/null || pgrep -f "sens21/run.sh" > /dev/null; do sleep 5; done
cd $S
echo "claude-code start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --experiment $CC --seeds 3 --jobs 2 --workloads claude-code --output 100 --baselines-from /tmp/cc20 --out $O/claude_code > $O/claude_code.log 2>&1
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --experiment $CC --seeds 3 --jobs 2 --workloads claude-code --output 400 --out $O/claude_code >> $O/claude_code.log 2>&1
PYTHONPATH=$S nice -n 2 $PY benchmarks/adaptive_grid.py --experiment $CC --seeds 3 --jobs 2 --workloads claude-code --out $O/claude_code >> $O/claude_code.log 2>&1
echo "check start $(date -u +%T)" >> $O/times_utc.txt
PYTHONPATH=$S nice -n 2 $PY $O/check_baselines.py $O/check_baselines.jsonl > $O/check_baselines.log 2>&1
echo "sensitivity cpd start $(date -u +%T)" >> $O/times_utc.txt
cd $S2
PYTHONPATH=$S2 nice -n 2 $PY -m cpd.sim.sensitivity reference_b200 --quick --seeds 3 --jobs 2 --configs cpd --earlier /tmp/sens21/static/sensitivity.json --out /tmp/sens21/all > /tmp/sens21/all.log 2>&1
echo "end $(date -u +%T)" >> $O/times_utc.txt
