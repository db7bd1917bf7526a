import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import benchmarks.modeled_ordering as mo
from cpd.engine.weights import make_tiny_llama_dir
md = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "t", seed=0))
vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
res = {}
for rc, ev in (("fixed", "step-end"), ("learned", "step-end"), ("learned", "next-flush")):
    g = []
    for seed in range(1, 11):
        a = mo.parse_args(["--points", "6", "--router-cost", rc, "--l3-events", ev, "--seed", str(seed)])
        reqs = mo.workload(a, 6.0)
        g.append(mo.summarise(mo.run_sim(a, "pd-l3", reqs, vocab, md), a, 7.5)["goodput"])
    res[f"{rc}/{ev}"] = g
    print(rc, ev, g, round(sum(g) / len(g), 4), flush=True)
json.dump(res, open("out/seeds6.json", "w"), indent=1)
