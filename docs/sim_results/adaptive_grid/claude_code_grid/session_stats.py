"""Claude Code sessions: requests per session, session length and gaps between a session's requests
with pauses capped at 60 s (the grid's max_idle_s before claude_code_sessions.experiment.json).
Run from the repository root: PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/claude_code_grid/session_stats.py"""
import numpy as np
from cpd.traces import read_trace
from cpd.traces.replay import _compress_idle
tr = read_trace("/work/shared/data/traces/claude_code")
durs, nreq, gaps, nsub = [], [], [], []
for s in tr.sessions:
    r = _compress_idle(s.requests, 60.0)
    durs.append(r[-1].t_s - r[0].t_s if r else 0)
    nreq.append(len(s.requests) + sum(len(x.session.requests) for x in s.subagents))
    nsub.append(len(s.subagents))
    gaps += [b.t_s - a.t_s for a, b in zip(r, r[1:])]
durs, nreq, gaps = map(np.array, (durs, nreq, gaps))
print("sessions", len(durs), "req/session mean", nreq.mean(), "median", np.median(nreq))
print("dur (max_idle 60) p10/50/90/mean", np.percentile(durs, [10, 50, 90]), durs.mean())
print("gap p10/50/90/mean", np.percentile(gaps, [10, 50, 90]), gaps.mean())
print("subagents mean", np.mean(nsub))
