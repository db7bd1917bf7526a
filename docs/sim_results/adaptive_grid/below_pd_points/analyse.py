"""Per-request comparison of adaptive cpd with the P/D configurations at one modeled-ordering point
(docs/sim_results/adaptive_grid/below_pd_points/README.md). Run from a snapshot root:

    PYTHONPATH=. nice -n 19 .venv/bin/python docs/sim_results/adaptive_grid/below_pd_points/analyse.py \
        SEED QPS [--configs pd,pd-l3,cpd] [--all] [--force I:WORKER,...]

Reruns the simulator (benchmarks/modeled_ordering.py --sim-only, measured window from duration / 4) and
prints goodput per configuration, then every measured request that misses the SLO under adaptive but
meets it under the best P/D configuration (or, with --all, every measured adaptive request), with the
adaptive decision: reason, class, chosen worker, each candidate's (wait, own, score), the estimated and
the actual TTFT, and the engine's queue time; and the session's previous turn (the earlier request with
the longest shared block prefix beyond the system prompt) with the worker it ran on.
--force I:W routes request I to worker W under adaptive (the same rules given only W on the prefill side).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")
import benchmarks.modeled_ordering as mo  # noqa: E402
import cpd.sim.engine_sim as es  # noqa: E402
from cpd.engine.weights import make_tiny_llama_dir  # noqa: E402

SYS_BLOCKS = 16
_last: dict = {}
_force: dict = {}
_sims: list = []
_route = es.route


def _route_rec(num_tokens, match, loads, cfg, cost):
    want = _force.get(_last.get("i"))
    if want is not None:
        only = [w for w in loads if w.role == "decode" or w.worker_id == want]
        if any(w.role != "decode" for w in only):
            loads = only
    d = _route(num_tokens, match, loads, cfg, cost)
    _last["d"] = d
    _last["match"] = match
    return d


es.route = _route_rec


class Sim(es.EngineSimulator):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        _sims.append(self)

    def _arrive(self, now, i, released=False):
        _last.clear()
        _last["i"] = i
        super()._arrive(now, i, released)
        d = _last.get("d")
        if d is not None and self.rec[i] is not None:
            self.rec[i]["cands"] = {c.worker_id: (c.wait_s, c.own_s, c.score) for c in d.candidates}
            self.rec[i]["est_ttft"] = d.estimated_ttft_s
            self.rec[i]["reason"] = str(d.reason)
            self.rec[i]["plan"] = (d.load_plan.l1_blocks, d.load_plan.l2_blocks, d.load_plan.l3_blocks)
            m = _last["match"]
            self.rec[i]["match"] = (dict(m.l1), dict(m.l2), m.l3, dict(m.l3_after), m.l3_pending)

    def _step_done(self, now, w, outs):
        for o in outs:
            rec = self.rec[int(o.request_id)]
            if o.queue_s is not None and "queue_s" not in rec:
                rec["queue_s"] = o.queue_s
        super()._step_done(now, w, outs)


mo.EngineSimulator = Sim


def lcp(x, y) -> int:
    n = 0
    for u, v in zip(x, y):
        if u != v:
            break
        n += 1
    return n


def short(w):
    return None if w is None else w.replace("pre-prefill-", "pp").replace("prefill-", "p").replace("decode-", "d")


def good(r, a) -> bool:
    return (r["ttft_s"] is not None and r["ttft_s"] <= a.slo_ttft and r["done"]
            and (r["output_tokens"] <= 1 or (r["tpot_s"] is not None and r["tpot_s"] <= a.slo_tpot)))


def main() -> None:
    args = sys.argv[1:]
    show_all = "--all" in args
    configs = ["pd", "pd-l3", "cpd"]
    pos = []
    it = iter(args)
    for x in it:
        if x == "--configs":
            configs = next(it).split(",")
        elif x == "--force":
            for f in next(it).split(","):
                i, w = f.split(":")
                _force[int(i)] = w
        elif x != "--all":
            pos.append(x)
    seed, qps = pos[0], float(pos[1])
    md = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "m", seed=0))
    vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
    a = mo.parse_args(["--sim-only", "--seed", seed])
    reqs = mo.workload(a, qps)
    warm = a.duration / 4
    win = [i for i, q in enumerate(reqs) if q.arrival_s >= warm]
    prev = {}
    for i, q in enumerate(reqs):
        best = max(range(i), key=lambda j: (lcp(reqs[j].blocks, q.blocks), j), default=None)
        if best is not None and lcp(reqs[best].blocks, q.blocks) > SYS_BLOCKS:
            prev[i] = best
    rows, recs = {}, {}
    for name in configs:
        f = dict(_force) if name == "cpd" else {}
        saved = dict(_force)
        _force.clear()
        _force.update(f)
        _sims.clear()
        rows[name] = mo.run_sim(a, name, reqs, vocab, md)
        recs[name] = _sims[-1].rec
        _force.clear()
        _force.update(saved)
        sm = mo.summarise(rows[name], a, warm)
        busy = {short(w.wid): round(w.busy_s, 2) for w in _sims[-1].insts} if hasattr(_sims[-1].insts[0], "busy_s") else {}
        print(f"{name}: goodput {sm['goodput']} of {sm['requests']}, ttft p90 {sm['ttft_s']['p90']}, "
              f"hit {sm['hit_ratio']}, pools {sm['pool_share']} busy {busy}")
    pdc = [c for c in configs if c != "cpd"]
    bestpd = max(pdc, key=lambda c: mo.summarise(rows[c], a, warm)["goodput"])
    print(f"best P/D: {bestpd}")
    ad = rows["cpd"]
    lost = [i for i in win if good(rows[bestpd][i], a) and not good(ad[i], a)]
    won = [i for i in win if not good(rows[bestpd][i], a) and good(ad[i], a)]
    print(f"good in {bestpd} only: {lost}; good in adaptive only: {won}")
    show = win if show_all else sorted(set(lost) | set(won))
    for i in show:
        q, r = reqs[i], recs["cpd"][i]
        p = prev.get(i)
        pw = short(recs["cpd"][p]["worker"]) if p is not None else None
        cands = " ".join(f"{short(w)}=({v[0]:.2f},{v[1]:.2f},{v[2]:.2f})" for w, v in r.get("cands", {}).items())
        pdr = recs[bestpd][i]
        flag = "LOST" if i in lost else ("WON" if i in won else ("ok" if good(ad[i], a) else "miss"))
        print(f"{flag:4s} #{i} t={q.arrival_s:.2f} n={q.prompt_tokens} prev=#{p}@{pw} {r.get('reason')} {r['cls']} "
              f"-> {short(r['worker'])} plan={r.get('plan')} est={r.get('est_ttft', 0):.2f} "
              f"ttft={ad[i]['ttft_s'] if ad[i]['ttft_s'] is None else round(ad[i]['ttft_s'], 2)} "
              f"q={r.get('queue_s', 0):.2f} tpot={ad[i]['tpot_s'] and round(ad[i]['tpot_s'], 3)} | {cands} | "
              f"{bestpd}: {short(pdr['worker'])} ttft={rows[bestpd][i]['ttft_s'] and round(rows[bestpd][i]['ttft_s'], 2)}"
              f" tpot={rows[bestpd][i]['tpot_s'] and round(rows[bestpd][i]['tpot_s'], 3)}")


if __name__ == "__main__":
    main()
