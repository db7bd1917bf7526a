#!/bin/bash
# session 21 (third rule, 7c0c647): adaptive cpd only, from a frozen snapshot (/tmp/snap21e); pd, pd-l3
# and cpd-static of every cell from session 20's grid (6d3ad44: their code path is unchanged, checked by
# check_baselines.py). Two chains, one per core, each with --jobs 1 (two agent searches at once fit in
# memory, three did not). $1: chain a (agent cold 0 and 0.03, then Mooncake) or b (agent cold 0.08 and
# 0.15, then the Claude Code cells with output 100, baselines from session 20's two runs merged)
echo 1000 > /proc/self/oom_score_adj
O=/work/main/docs/sim_results/adaptive_grid/session21
B=/work/main/docs/sim_results/adaptive_grid/session20
S=/tmp/snap21e
PY=/work/main/.venv/bin/python
CC=docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json
G="nice -n 2 $PY benchmarks/adaptive_grid.py --seeds 3 --jobs 1"
cd $S
echo "7c0c647 (snapshot: git archive, run with PYTHONPATH=snapshot)" > $O/commit.txt
export PYTHONPATH=$S
if [ "$1" = a ]; then
  echo "a: agent start $(date -u +%T)" >> $O/times_utc.txt
  $G --quick --cold 0,0.03 --ttft 0.5,1,2 --output 100,400 --workloads agent --baselines-from $B/agent --out $O/agent >> $O/agent_a.log 2>&1
  echo "a: mooncake start $(date -u +%T)" >> $O/times_utc.txt
  $G --experiment docs/sim_results/adaptive_grid/decode2_short.experiment.json --workloads mooncake --baselines-from $B/mooncake --out $O/mooncake > $O/mooncake.log 2>&1
else
  mkdir -p /tmp/cc20/cells && cp $B/claude_code/cells/*.json $B/claude_code_b/cells/*.json /tmp/cc20/cells/
  echo "b: agent start $(date -u +%T)" >> $O/times_utc.txt
  $G --quick --cold 0.08,0.15 --ttft 0.5,1,2 --output 100,400 --workloads agent --baselines-from $B/agent --out $O/agent >> $O/agent_b.log 2>&1
  echo "b: claude-code start $(date -u +%T)" >> $O/times_utc.txt
  $G --experiment $CC --workloads claude-code --output 100 --baselines-from /tmp/cc20 --out $O/claude_code > $O/claude_code.log 2>&1
fi
echo "$1: end $(date -u +%T)" >> $O/times_utc.txt
