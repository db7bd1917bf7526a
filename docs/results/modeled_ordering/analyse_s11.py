"""Session 11: live records vs the simulator, request by request (docs/results/modeled_ordering/README.md).

Run from a snapshot root (PYTHONPATH=.) holding the live records of a run of
benchmarks/modeled_ordering_records.py::

    PYTHONPATH=. python docs/results/modeled_ordering/analyse_s11.py [-v] [--force] RECORDS_DIR QPS:CONFIG [...]

For each point/configuration it reruns the simulator with the benchmark's defaults (seed 1, K = 3),
instrumented to keep per request the chosen prefill worker, the router's candidates, the engine's
queue time and the tiers, and prints, over the measured window (arrivals from 7.5 s):

- goodput, mean TTFT / queue / compute (modeled s) on both sides; live compute is
  ``worker_compute_s``, simulated compute is ``TTFT - queue_s`` (the simulator has no time outside
  the worker);
- computed (uncached) prompt tokens and tier tokens (L1/L2/L3) on both sides;
- *moves*: turns whose prefill worker is not the worker of the session's previous turn (previous
  turn = the earlier request sharing the longest block prefix, beyond the shared system prompt),
  on each side; and how often the two sides chose the same worker (names prefill-i = pi);
- each prefill worker's busy time (simulator: ``busy_s``; live: the union of the requests' compute
  intervals ``[t + ttft - compute, t + ttft]``) and its summed compute tokens;
- the router's own estimate: mean ``estimated TTFT - TTFT`` on each side (live: /K), and the live
  prefill rate (``step_tokens / step_s`` × K) against the roofline's;
- with ``-v``: one line per measured request;
- with ``--force``: the simulator routes every request to the prefill worker the live router chose
  (the same rules given only that worker on the prefill side: its own load plan there), which
  separates a difference of the routing decisions from a difference of the serving mechanism;
- with ``--defer-l3``: the simulator's write-through blocks become visible in L3 when the step that
  computed them ends (buffered here, written in ``_step_done``), not when ``Engine.step()`` runs at
  the step's virtual start (the proposed simulator fix, tried without changing cpd).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")
import numpy as np  # noqa: E402

import benchmarks.modeled_ordering as mo  # noqa: E402
import cpd.sim.engine_sim as es  # noqa: E402
from cpd.store.connector import L3Connector  # noqa: E402

es.L3Connector_save = L3Connector.save
from cpd.engine.weights import make_tiny_llama_dir  # noqa: E402

K = 3.0
WARM = float(os.environ.get("WARM_S", "7.5"))  # the measured window starts here (the benchmark: duration / 4)
SYS_BLOCKS = 16  # the shared system prompt (1024 tokens / 64)

_last = {}
_route = es.route


def _route_rec(num_tokens, match, loads, cfg, cost):
    """The router's decision; with ``_force`` (request index -> live worker), the decision of the
    same rules given only the worker the live router chose on the prefill side."""
    want = _force.get(_last.get("i"))
    if want is not None:
        only = [w for w in loads if w.role == "decode" or wname(w.worker_id) == want]
        if any(w.role != "decode" for w in only):
            loads = only
    d = _route(num_tokens, match, loads, cfg, cost)
    _last["d"] = d
    return d


es.route = _route_rec
_sims: list = []
_force: dict = {}
_defer_l3 = "--defer-l3" in sys.argv
_held_writes: dict = {}


class Sim(es.EngineSimulator):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        _sims.append(self)

    def _arrive(self, now, i, released=False):
        _last.pop("d", None)
        _last["i"] = i
        super()._arrive(now, i, released)
        d = _last.get("d")
        if d is not None and self.rec[i] is not None:
            self.rec[i]["cands"] = {c.worker_id: (c.wait_s, c.own_s, c.score) for c in d.candidates}
            self.rec[i]["est_ttft"] = d.estimated_ttft_s
            self.rec[i]["plan"] = (d.load_plan.l1_blocks, d.load_plan.l2_blocks, d.load_plan.l3_blocks)

    def _instance(self, wid, spec):
        w = super()._instance(wid, spec)
        con = w.engine.connector
        if _defer_l3 and con is not None:  # write-through visible at the end of the step (proposed fix)
            held: list = []
            con.save = lambda h, p, t, b, _held=held: _held.append((h, p, t, [np.array(x, copy=True) for x in b]))
            _held_writes[wid] = (con, held)
        return w

    def _step_done(self, now, w, outs):
        con_held = _held_writes.get(w.wid)
        if con_held is not None and con_held[1]:
            con, held = con_held
            for job in held:
                es.L3Connector_save(con, *job)
            held.clear()
            self._publish(now, w)
        for o in outs:
            rec = self.rec[int(o.request_id)]
            if o.queue_s is not None and "queue_s" not in rec:
                rec["queue_s"] = o.queue_s
                rec["step"] = (o.step_tokens, o.step_s)
        super()._step_done(now, w, outs)


mo.EngineSimulator = Sim
_steps: dict = {}  # id(engine) -> [steps that computed tokens, tokens]
_orig_step = es.Engine.step


def _counted_step(self):
    t0 = self.step_tokens_total
    res = _orig_step(self)
    if self.step_tokens_total != t0:
        c = _steps.setdefault(id(self), [0, 0])
        c[0] += 1
        c[1] += self.step_tokens_total - t0
    return res


es.Engine.step = _counted_step


def lcp(x, y) -> int:
    n = 0
    for u, v in zip(x, y):
        if u != v:
            break
        n += 1
    return n


def wname(w: str | None) -> str | None:
    if w is None:
        return None
    return w.replace("pre-prefill-", "pp").replace("prefill-", "p").replace("decode-", "d")


def union_s(iv: list[tuple[float, float]]) -> float:
    tot, end = 0.0, -1e18
    for a, b in sorted(iv):
        if b <= end:
            continue
        tot += b - max(a, end)
        end = b
    return tot


def main() -> None:
    verbose = "-v" in sys.argv
    force = "--force" in sys.argv
    args = [x for x in sys.argv[1:] if x not in ("-v", "--force", "--defer-l3")]
    rec_dir = Path(args[0])
    tmp = tempfile.mkdtemp()
    md = str(make_tiny_llama_dir(Path(tmp) / "t", seed=0))
    vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
    for spec in args[1:]:
        qps_s, name = spec.split(":")
        qps = float(qps_s)
        a = mo.parse_args(["--points", qps_s])
        reqs = mo.workload(a, qps)
        live = [json.loads(x) for x in open(rec_dir / f"{mo.reqs_tag(reqs)}-{name}.jsonl")]
        _force.clear()
        if force:
            _force.update({i: x["record"]["prefill_worker"] for i, x in enumerate(live) if x.get("record")})
        _sims.clear()
        _steps.clear()
        _held_writes.clear()
        rows = mo.run_sim(a, name, reqs, vocab, md)
        sim = _sims[-1]
        srec = sim.rec
        win = [i for i, q in enumerate(reqs) if q.arrival_s >= WARM]
        # previous turn of the same session
        prev = {}
        for i, q in enumerate(reqs):
            best = max(range(i), key=lambda j: (lcp(reqs[j].blocks, q.blocks), j), default=None)
            if best is not None and lcp(reqs[best].blocks, q.blocks) > SYS_BLOCKS:
                prev[i] = best
        s_summ = mo.summarise(rows, a, WARM)
        print(f"\n=== {qps:g} QPS {name}: {len(win)} measured; sim goodput {s_summ['goodput']}"
              + (" (simulator forced to the live run's prefill worker for every request)" if force else "")
              + (" (write-through visible at the end of its step)" if _defer_l3 else ""))
        agg = {k: 0.0 for k in ("s_ttft", "s_q", "s_c", "l_ttft", "l_q", "l_c", "s_est_err", "l_est_err")}
        tiers = {"sim": {"L1": 0, "L2": 0, "L3": 0, "unc": 0}, "live": {"L1": 0, "L2": 0, "L3": 0, "unc": 0}}
        moves = {"sim": 0, "live": 0, "turns": 0}
        same_w = 0
        l3_not_l2 = {"same_worker": 0, "other_worker": 0, "tokens_same": 0, "tokens_other": 0}
        lines = []
        n = 0
        rates, s_rates = [], []
        for i in win:
            q, s, l_ = reqs[i], srec[i], live[i]["record"]
            if l_ is None or l_.get("ttft_s") is None or s.get("ttft_t") is None:
                continue
            n += 1
            s_ttft = s["ttft_t"] - s["arrival"]
            s_q = s.get("queue_s", 0.0)
            l_ttft, l_q, l_c = l_["ttft_s"] / K, l_["worker_queue_s"] / K, l_["worker_compute_s"] / K
            agg["s_ttft"] += s_ttft
            agg["s_q"] += s_q
            agg["s_c"] += s_ttft - s_q
            agg["l_ttft"] += l_ttft
            agg["l_q"] += l_q
            agg["l_c"] += l_c
            agg["s_est_err"] += s["est_ttft"] - s_ttft
            agg["l_est_err"] += l_["estimated_ttft_s"] / K - l_ttft
            lt = l_["cached_tokens_by_tier"]
            st = {"L1": s.get("l1", 0), "L2": s.get("l2", 0), "L3": s.get("l3", 0)}
            for t in ("L1", "L2", "L3"):
                tiers["sim"][t] += st[t]
                tiers["live"][t] += lt[t]
            tiers["sim"]["unc"] += q.prompt_tokens - sum(st.values())
            tiers["live"]["unc"] += q.prompt_tokens - sum(lt.values())
            sw, lw = wname(s["worker"]), l_["prefill_worker"]
            same_w += sw == lw
            if i in prev:
                moves["turns"] += 1
                j = prev[i]
                moves["sim"] += wname(srec[j]["worker"]) != sw
                moves["live"] += (live[j]["record"] or {}).get("prefill_worker") != lw
            if lt["L3"] > st["L3"] + 64:
                same = (i in prev and (live[prev[i]]["record"] or {}).get("prefill_worker") == lw)
                l3_not_l2["same_worker" if same else "other_worker"] += 1
                l3_not_l2["tokens_same" if same else "tokens_other"] += lt["L3"] - st["L3"]
            if l_.get("step_s"):
                rates.append(l_["step_tokens"] / l_["step_s"] * K)
            if s.get("step") and s["step"][1]:
                s_rates.append(s["step"][0] / s["step"][1])
            lc = {c["worker_id"]: (round(c["wait_s"] / K, 2), round(c["own_s"] / K, 2)) for c in l_["candidates"]}
            sc = {wname(w): (round(v[0], 2), round(v[1], 2)) for w, v in s.get("cands", {}).items()}
            lines.append(f"{i:3d} t={q.arrival_s:5.2f} tok={q.prompt_tokens:5d} prev={prev.get(i, '-')!s:>3} "
                         f"sim {sw} {st} q={s_q:.2f} ttft={s_ttft:.2f} c={sc} | live {lw} {lt} q={l_q:.2f} "
                         f"c={l_c:.2f} ttft={l_ttft:.2f} est={l_['estimated_ttft_s'] / K:.2f} cand={lc}")
        m = max(n, 1)
        print(f"TTFT mean sim {agg['s_ttft'] / m:.2f} live {agg['l_ttft'] / m:.2f}; queue sim {agg['s_q'] / m:.2f} "
              f"live {agg['l_q'] / m:.2f}; compute sim {agg['s_c'] / m:.2f} live {agg['l_c'] / m:.2f}")
        print(f"router estimate - actual TTFT, mean: sim {agg['s_est_err'] / m:+.2f} live {agg['l_est_err'] / m:+.2f}")
        print(f"tokens (window): sim {tiers['sim']} live {tiers['live']} "
              f"computed live/sim {tiers['live']['unc'] / max(1, tiers['sim']['unc']):.3f}")
        print(f"turns {moves['turns']}: moved off the previous turn's worker sim {moves['sim']} live {moves['live']}; "
              f"same worker both sides {same_w}/{n}")
        print(f"requests loading >64 more L3 tokens live than sim: {l3_not_l2}")
        if rates and s_rates:
            rs, ss = sorted(rates), sorted(s_rates)
            print(f"engine rate over each request's steps (step_tokens / step_s, tok/s; live x K): median sim "
                  f"{ss[len(ss) // 2]:.0f} live {rs[len(rs) // 2]:.0f}; mean sim {sum(ss) / len(ss):.0f} live "
                  f"{sum(rs) / len(rs):.0f} (router's roofline rate "
                  f"{mo.router_cost(a, mo.RooflineCostModel.build(a.shape, a.gpu, a.tp)).prefill_tokens_per_s:.0f})")
        # per-worker busy time and work, all requests (not just the window)
        busy = sim.busy_s()
        for w in sorted({wname(r["worker"]) for r in srec if r and r.get("worker")}):
            if w.startswith("d"):
                continue
            s_idx = [i for i, r in enumerate(srec) if r and wname(r["worker"]) == w]
            l_idx = [i for i, x in enumerate(live) if x["record"] and x["record"]["prefill_worker"] == w]
            iv = []
            for i in l_idx:
                r = live[i]["record"]
                t_end = reqs[i].arrival_s + r["ttft_s"] / K
                iv.append((t_end - r["worker_compute_s"] / K, t_end))
            s_unc = sum(reqs[i].prompt_tokens - sum(srec[i].get(t, 0) for t in ("l1", "l2", "l3")) for i in s_idx)
            l_unc = sum(reqs[i].prompt_tokens - sum(live[i]["record"]["cached_tokens_by_tier"].values()) for i in l_idx)
            sb = next((v for k, v in busy.items() if wname(k) == w), 0.0)
            inst = next(x for x in sim.insts if wname(x.wid) == w)
            ns, nt = _steps.get(id(inst.engine), [0, 0])
            print(f"  {w}: sim {len(s_idx)} req, {s_unc} computed tok, {ns} steps ({nt} tok), busy {sb:.1f} s | "
                  f"live {len(l_idx)} req, "
                  f"{l_unc} computed tok, compute-interval union {union_s(iv):.1f} s")
        if verbose:
            print("\n".join(lines))


if __name__ == "__main__":
    main()
