"""Row-level determinism: run_sim twice (learned) on the same requests, hash the rows."""
import hashlib, json, sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import benchmarks.modeled_ordering as mo
import benchmarks.claude_code_live_modeled as cc
from cpd.engine.weights import make_tiny_llama_dir
md = str(make_tiny_llama_dir(Path(tempfile.mkdtemp()) / "t", seed=0))
vocab = json.loads((Path(md) / "config.json").read_text())["vocab_size"]
argv = ["--points", "36", "--duration", "120", "--warm", "60", "--time-dilation", "4", "--l3-events", sys.argv[1]]
for k, v in cc.CELL_DEFAULTS.items():
    argv += [k, v]
a = mo.parse_args(argv)
for k, v in dict(ramp=60.0, steady=60.0, time_scale=4.0, max_idle=20.0, max_output=100, trace=cc.CLAUDE_CODE_TRACE).items():
    setattr(a, k, v)
reqs = cc.claude_code_requests(a, 36.0)
for name in ("pd-l3", "cpd"):
    hs = []
    for _ in range(2):
        info = {}
        rows = mo.run_sim(a, name, reqs, vocab, md, info=info)
        hs.append(hashlib.sha256(json.dumps([rows, info], sort_keys=True).encode()).hexdigest())
    print(name, sys.argv[1], hs, "IDENTICAL" if hs[0] == hs[1] else "DIFFERENT", flush=True)
