"""A3 candidates at single points: python a3s/probe.py CAND OUT.jsonl SPEC... ; SPEC = wl:ttft:out:seed:q[:cfg]
(wl: cc | agentCOLD | mc). Monkeypatches cpd.policy.routing for the candidate, runs run_point."""
import json, sys, time, collections
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
import cpd.policy.routing as R
from cpd.types import Role, Topology
from cpd.sim.experiment import load_experiment, run_point, with_overrides
from cpd.sim.sweep import search_saturation

EXP = {"cc": "docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json",
       "mc": "docs/sim_results/adaptive_grid/decode2_short.experiment.json",
       "agent": "benchmarks/experiments/reference_b200.json"}
orig_choose = R._choose_prefill_side
STATS = collections.Counter()

def choose_gain(cands, heavy, cfg, factor=1.0):
    """heavy spill only if it saves this request more than the delay it adds behind it (own_s)."""
    win, reason, fb = orig_choose(cands, heavy, cfg)
    if heavy and reason == R.DecisionReason.SPILL_COLD:
        home = [c for c in cands if c.load.role == Role.PRE_PREFILL]
        best_home = R._best(home)
        STATS["spill_cold"] += 1
        if best_home.est.ttft_s - win.est.ttft_s <= factor * win.est.own_s:
            STATS["kept_home"] += 1
            return best_home, R.DecisionReason.HOME, None
    return win, reason, fb

SPILLS = []
def count_only(cands, heavy, cfg):
    win, reason, fb = orig_choose(cands, heavy, cfg)
    STATS[str(reason)] += 1
    if reason == R.DecisionReason.SPILL_COLD:
        h = R._best([c for c in cands if c.load.role == Role.PRE_PREFILL])
        SPILLS.append((round(h.est.wait_s, 3), round(h.est.own_s, 3), round(win.est.wait_s, 3), round(win.est.own_s, 3)))
    return win, reason, fb

def no_hopeless(cands, heavy, cfg):
    R.HOPELESS_WAIT_FACTOR = float("inf")
    return count_only(cands, heavy, cfg)

import collections as _c
import cpd.sim.engine_sim as ES
NOW = [0.0]
_orig_arrive = ES.EngineSimulator._arrive
def _arrive(self, now, i, released=False):
    NOW[0] = now
    return _orig_arrive(self, now, i, released)
ES.EngineSimulator._arrive = _arrive
SHORT_T = _c.deque()
WINDOW_S = [10.0]
orig_fits = R._short_work_still_fits
def fits_rate(c, prefill_pool, home_wait_s, cfg):
    waits = [p.est.wait_s + (c.est.own_s if p is c else 0.0) for p in prefill_pool]
    if min(waits) <= cfg.ttft_slo_s:
        return True
    if not (c.est.own_s > cfg.ttft_slo_s and home_wait_s > R.HOPELESS_WAIT_FACTOR * c.est.own_s and min(waits) <= c.est.own_s):
        return False
    rate = len(SHORT_T) / WINDOW_S[0]
    STATS["hopeless_asked"] += 1
    ok = rate * (c.est.wait_s + c.est.own_s - cfg.ttft_slo_s) < 1.0
    STATS["hopeless_ok"] += ok
    return ok
def rate_choose(cands, heavy, cfg):
    while SHORT_T and SHORT_T[0] < NOW[0] - WINDOW_S[0]:
        SHORT_T.popleft()
    win, reason, fb = count_only(cands, heavy, cfg)
    if not heavy and win.load.role == Role.PREFILL:
        SHORT_T.append(NOW[0])
    return win, reason, fb
def mk_rate(w):
    def f(cands, heavy, cfg):
        WINDOW_S[0] = w
        R._short_work_still_fits = fits_rate
        return rate_choose(cands, heavy, cfg)
    return f

CANDS = {"rate10": mk_rate(10.0), "rate30": mk_rate(30.0), "nohopeless": no_hopeless, "base": count_only, "gain": choose_gain, "gain05": lambda c, h, g: choose_gain(c, h, g, 0.5),
         "gain2": lambda c, h, g: choose_gain(c, h, g, 2.0)}

def exp_of(wl, ttft, out):
    if wl == "cc" or wl == "mc":
        base = load_experiment(EXP[wl])
        return G.cell_experiment(base, {"workload": "claude-code" if wl == "cc" else "mooncake", "cold": None, "ttft_s": ttft, "output": out})
    base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
    return G.cell_experiment(base, {"workload": "agent", "cold": float(wl[5:]), "ttft_s": ttft, "output": out})

def main():
    cand, out = sys.argv[1], sys.argv[2]
    R._choose_prefill_side = CANDS[cand]
    for spec in sys.argv[3:]:
        parts = spec.split(":")
        wl, ttft, o, seed, q = parts[0], float(parts[1]), int(parts[2]), int(parts[3]), float(parts[4])
        cfg = parts[5] if len(parts) > 5 else "cpd"
        STATS.clear(); SPILLS.clear(); SHORT_T.clear(); t = time.perf_counter()
        if q < 0:   # saturation search of cfg
            r = search_saturation(exp_of(wl, ttft, o), cfg, seed)
            p = {"goodput": r["qps_per_gpu"], "requests": [(x["qps_per_gpu"], round(x["goodput"], 4)) for x in r["points"]]}
        else:
            p = run_point(exp_of(wl, ttft, o), cfg, q, seed)
        row = {"cand": cand, "spec": spec, "cfg": cfg, "goodput": p["goodput"], "requests": p.get("requests"),
               "decisions": dict(STATS), "spills_home_wait_own_other_wait_own": SPILLS[:200], "wall_s": round(time.perf_counter() - t, 1),
               "end_utc": time.strftime("%H:%M:%S", time.gmtime())}
        print(json.dumps(row), flush=True)
        with open(out, "a") as f: f.write(json.dumps(row) + "\n")
main()
