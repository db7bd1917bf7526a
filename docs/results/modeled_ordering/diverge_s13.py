"""pd-l3 6 QPS: the simulator's prefill worker per request vs the live records (session 12 runs a, b)."""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import benchmarks.modeled_ordering as mo
from cpd.engine.weights import make_tiny_llama_dir
md = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "t", seed=0))
vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
live = {r: [json.loads(l)["record"]["prefill_worker"] for l in open(f"/tmp/rec12/records_{r}/159req-30s-pd-l3.jsonl")] for r in "ab"}
keep = {}
class S(mo.EngineSimulator):
    def run(self):
        keep["sim"] = self
        return super().run()
mo.EngineSimulator = S
for rc, ev in (("fixed", "step-end"), ("learned", "step-end"), ("learned", "next-flush")):
    a = mo.parse_args(["--points", "6", "--router-cost", rc, "--l3-events", ev])
    reqs = mo.workload(a, 6.0)
    rows = mo.run_sim(a, "pd-l3", reqs, vocab, md)
    sim = keep["sim"]
    w = ["p" + x["worker"].split("-")[-1] for x in sim.rec]
    out = [rc, ev, mo.summarise(rows, a, 7.5)["goodput"]]
    for r in "ab":
        first = next((i for i, (x, y) in enumerate(zip(w, live[r])) if x != y), None)
        win = [i for i, q in enumerate(reqs) if q.arrival_s >= 7.5]
        out.append(f"run {r}: first differing request {first}, same worker {sum(w[i] == live[r][i] for i in win)}/{len(win)}")
    print(*out, flush=True)
# second part (diverge2.py): the router's candidates per request, sim vs live run a
# import json, sys, tempfile
# from pathlib import Path
# sys.path.insert(0, ".")
# import benchmarks.modeled_ordering as mo
# import cpd.sim.engine_sim as es
# from cpd.engine.weights import make_tiny_llama_dir
# md = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "t", seed=0))
# vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
# live = [json.loads(l) for l in open("/tmp/rec12/records_a/159req-30s-pd-l3.jsonl")]
# dec = []
# orig = es.route
# def rr(n, match, loads, cfg, cost):
#     d = orig(n, match, loads, cfg, cost); dec.append(d); return d
# es.route = rr
# a = mo.parse_args(["--points", "6", "--l3-events", sys.argv[1]])
# reqs = mo.workload(a, 6.0)
# mo.run_sim(a, "pd-l3", reqs, vocab, md)
# for i in range(int(sys.argv[2]), int(sys.argv[3])):
#     L = live[i]["record"]; d = dec[i]
#     lc = " ".join(f"{c['worker_id']}:w{c['wait_s']/3:.2f}+o{c['own_s']/3:.2f}" for c in L["candidates"])
#     sc = " ".join(f"{c.worker_id}:w{c.wait_s:.2f}+o{c.own_s:.2f}" for c in d.candidates)
#     print(i, f"t={reqs[i].arrival_s:.2f}", "live", L["prefill_worker"], lc, "| sim", d.prefill_worker, sc, "| L3 live", L.get("cached_tokens_by_tier"))
