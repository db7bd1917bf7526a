import json,glob,sys
sys.path.insert(0,'/work/main')
import argparse
import benchmarks.modeled_ordering as mo
a=argparse.Namespace(goodput_tol=0.03,ttft_tol=0.10)
"""Goodput (TTFT p90) and the simulator order per file; run inside sim_learned/."""
for f in sorted(glob.glob("cc_l*_s*.json"))+["cc_l2_learned.json","cc_l3_learned.json","cc_l2_fixed.json","cc_l3_fixed.json"]:
    r=json.load(open(f)); p=r["points"][0]
    summ={n:c["sim"] for n,c in p["configs"].items()}
    print(f, p["window_requests"], {n:(s["goodput"],s["ttft_s"]["p90"]) for n,s in summ.items()}, mo.ordering(summ,a)[0])
