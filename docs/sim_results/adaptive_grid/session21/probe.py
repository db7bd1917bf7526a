"""Session 21 probe: adaptive cpd alone on one grid cell and seed, with rule A3's two-sided price as
on main (``base``) or a variant monkeypatched into cpd.policy.routing:
  ``no-short-move``  the heavy spill's two-sided price only (short work never moves by the price);
  ``short-move-1``   short work moves only where it saves at least one expected miss;
  ``heavy-short-side`` the heavy spill priced as in session 20 (misses behind the prefill pool
                      after the spill < 1), the short move kept;
  ``heavy-s20``      the heavy spill priced exactly as in session 20 (short arrivals only);
  ``short-move-large`` short work moves by the price only if its own work exceeds twice the mean
                      estimate of its home pool's dispatches.
PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/session21/probe.py VARIANT[+VARIANT] OUT.jsonl SPEC...
SPEC = agent:COLD:TTFT:OUT:SEED | mooncake:TTFT:OUT:SEED | claude-code:TTFT:OUT:SEED"""
import json, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
import cpd.policy.routing as R
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation

EXP = {"mooncake": "docs/sim_results/adaptive_grid/decode2_short.experiment.json",
       "claude-code": "docs/sim_results/adaptive_grid/claude_code_grid/claude_code_sessions.experiment.json"}
orig_expected = R._expected_misses


def short_move_at_least(k):
    def expected(c, pool, cfg):
        # the move test compares other < home; adding k to the other side asks for k misses saved
        v = orig_expected(c, pool, cfg)
        return v + k if c.load.role == R.Role.PRE_PREFILL else v
    return expected


def short_move_large(factor):
    def expected(c, pool, cfg):
        v = orig_expected(c, pool, cfg)
        if c.load.role != R.Role.PREFILL:
            return v
        rate = sum(p.load.short_arrivals_per_s + p.load.heavy_arrivals_per_s for p in pool)
        work = sum(p.load.short_work_per_s + p.load.heavy_work_per_s for p in pool)
        # home (prefill) side: the move is allowed only for requests above factor x the mean
        return v if rate > 0 and c.est.own_s > factor * work / rate else float("-inf")
    return expected


def heavy_short_side(c, prefill_pool, best_home, home_pool, cfg):
    lowest = min(p.est.wait_s + (c.est.own_s if p is c else 0.0) for p in prefill_pool)
    if lowest > cfg.ttft_slo_s:
        hopeless = c.est.own_s > cfg.ttft_slo_s and best_home.est.wait_s > R.HOPELESS_WAIT_FACTOR * c.est.own_s \
            and lowest <= c.est.own_s + R.QUEUE_RESOLUTION_S
        if not hopeless:
            return False
    return R._misses_behind(lowest, prefill_pool, cfg) < 1.0


def heavy_s20(c, prefill_pool, best_home, home_pool, cfg):
    """Session 20's heavy spill price exactly (6d3ad44): short arrivals only, absolute, < 1."""
    lowest = min(p.est.wait_s + (c.est.own_s if p is c else 0.0) for p in prefill_pool)
    if lowest > cfg.ttft_slo_s:
        hopeless = c.est.own_s > cfg.ttft_slo_s and best_home.est.wait_s > R.HOPELESS_WAIT_FACTOR * c.est.own_s \
            and lowest <= c.est.own_s + R.QUEUE_RESOLUTION_S
        if not hopeless:
            return False
    rate = sum(p.load.short_arrivals_per_s for p in prefill_pool)
    if rate <= 0.0:
        return True
    work = sum(p.load.short_work_per_s for p in prefill_pool)
    bound = R.SLO_PREDICTION_SHARE * cfg.ttft_slo_s - work / rate
    drain = max(R.MIN_DRAIN_SHARE, 1.0 - work / len(prefill_pool))
    return rate * max(0.0, lowest - bound) / drain < 1.0


def apply(variants):
    for v in variants.split("+"):
        apply_one(v)


def apply_one(variant):
    if variant == "no-short-move":
        R._expected_misses = short_move_at_least(float("inf"))
    elif variant == "short-move-1":
        R._expected_misses = short_move_at_least(1.0)
    elif variant == "short-move-large":
        R._expected_misses = short_move_large(2.0)
    elif variant == "heavy-s20":
        R._heavy_spill_pays = heavy_s20
    elif variant == "heavy-short-side":
        R._heavy_spill_pays = heavy_short_side
    elif variant != "base":
        raise SystemExit(f"unknown variant {variant}")


def experiment(spec):
    f = spec.split(":")
    if f[0] == "agent":
        cell = {"workload": "agent", "cold": float(f[1]), "ttft_s": float(f[2]), "output": int(f[3])}
        base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
        return G.cell_experiment(base, cell), int(f[4])
    cell = {"workload": f[0], "cold": None, "ttft_s": float(f[1]), "output": int(f[2])}
    return G.cell_experiment(load_experiment(EXP[f[0]]), cell), int(f[3])


apply(sys.argv[1])
out = open(sys.argv[2], "a")
for spec in sys.argv[3:]:
    e, seed = experiment(spec)
    t = time.time(); r = search_saturation(e, "cpd", seed)
    out.write(json.dumps({"variant": sys.argv[1], "spec": spec, "sat": r["qps_per_gpu"],
                          "pts": [(p["qps_per_gpu"], p["goodput"]) for p in r["points"]],
                          "wall_s": round(time.time() - t, 1)}) + "\n"); out.flush()
