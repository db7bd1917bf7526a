"""Session 19 probe: rule A3's "short work still fits" test with the estimate's error allowed for
(the prefill pool keeps a worker whose queue, this heavy request included, is at most
SHARE x ttft_slo_s; SHARE = 1 is today's rule). Adaptive cpd searches, queue_remaining off.
PYTHONPATH=. .venv/bin/python docs/sim_results/adaptive_grid/session19/probe_fits_share.py SHARE COLD:TTFT:OUT:SEED ..."""
import json, sys, time
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import adaptive_grid as G
import cpd.policy.routing as R
from cpd.sim.experiment import load_experiment, with_overrides
from cpd.sim.sweep import search_saturation

SHARE = float(sys.argv[1])
_orig = R._short_work_still_fits


def fits(c, prefill_pool, home_wait_s, cfg):
    waits = [p.est.wait_s + (c.est.own_s if p is c else 0.0) for p in prefill_pool]
    if min(waits) <= SHARE * cfg.ttft_slo_s:
        return True
    if min(waits) <= cfg.ttft_slo_s:  # fits today's test but not the shared one: only the hopeless path
        return c.est.own_s > cfg.ttft_slo_s and _orig(c, prefill_pool, home_wait_s, cfg)
    return _orig(c, prefill_pool, home_wait_s, cfg)


R._short_work_still_fits = fits
for spec in sys.argv[2:]:
    cold, ttft, out, seed = spec.split(":")
    base = with_overrides(load_experiment("reference_b200"), G.QUICK_EXP)
    e = G.cell_experiment(base, {"workload": "agent", "cold": float(cold), "ttft_s": float(ttft), "output": int(out)})
    t = time.time(); r = search_saturation(e, "cpd", int(seed))
    print(json.dumps({"spec": spec, "share": SHARE, "cfg": "cpd", "sat": r["qps_per_gpu"],
                      "pts": [(p["qps_per_gpu"], p["goodput"]) for p in r["points"]], "s": round(time.time() - t)}), flush=True)
