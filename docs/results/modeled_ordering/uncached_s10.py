"""Session 10: per request, the uncached (computed) prompt tokens of the simulator vs the live run.

Run from a snapshot root holding ``records/`` (benchmarks/modeled_ordering_records.py):
    PYTHONPATH=. python docs/results/modeled_ordering/uncached_s10.py
For each listed point and configuration: the measured window's uncached tokens on both sides and
how many requests computed more live; for pd at 4.5 QPS, each such request with the worker its
session's previous turn ran on and the live router's candidates (wait_s, own_s: wall seconds).
"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0,'.')
import benchmarks.modeled_ordering as mo
from cpd.engine.weights import make_tiny_llama_dir
tmp=tempfile.mkdtemp(); md=str(make_tiny_llama_dir(Path(tmp)/'t',seed=0))
vocab=json.loads((Path(md)/'config.json').read_text())['vocab_size']
for qps,names in ((4.5,("pd","pd-l3","cpd")),(6.0,("pd","pd-l3","cpd"))):
    a=mo.parse_args(['--points',str(qps)])
    reqs=mo.workload(a,qps)
    tag=mo.reqs_tag(reqs)
    for name in names:
        sim=mo.run_sim(a,name,reqs,vocab,md)
        live=[json.loads(l) for l in open(f'records/{tag}-{name}.jsonl')]
        us=sum(q.prompt_tokens-sum(s['tiers'].values()) for q,s in zip(reqs,sim) if q.arrival_s>=7.5)
        ul=sum(q.prompt_tokens-sum(l['record']['cached_tokens_by_tier'].values()) for q,l in zip(reqs,live) if q.arrival_s>=7.5)
        more=sum(1 for q,s,l in zip(reqs,sim,live) if q.arrival_s>=7.5 and (q.prompt_tokens-sum(l['record']['cached_tokens_by_tier'].values()))>(q.prompt_tokens-sum(s['tiers'].values()))+64)
        print(qps,name,'window uncached sim',us,'live',ul,'ratio %.3f'%(ul/us),'reqs with more live',more)
print('--- pd detail')
a=mo.parse_args(['--points','4.5']); reqs=mo.workload(a,4.5); sim=mo.run_sim(a,'pd',reqs,vocab,md)
live=[json.loads(l) for l in open('records/127req-30s-pd.jsonl')]
def lcp(x,y):
    n=0
    for u,v in zip(x,y):
        if u!=v: break
        n+=1
    return n
for i,(q,s,l) in enumerate(zip(reqs,sim,live)):
    if q.arrival_s<7.5: continue
    r=l['record']
    us=q.prompt_tokens-sum(s['tiers'].values()); ul=q.prompt_tokens-sum(r['cached_tokens_by_tier'].values())
    if ul<=us+64: continue
    prev=max(range(i), key=lambda j: (lcp(reqs[j].blocks,q.blocks), j))
    pr=live[prev]['record']
    c={x['worker_id']:(round(x['wait_s'],1),round(x['own_s'],2)) for x in r['candidates']}
    print(i,'arr %.1f'%q.arrival_s,'tok',q.prompt_tokens,'unc sim',us,'live',ul,'live tiers',r['cached_tokens_by_tier'],'w',r['prefill_worker'],'prev',prev,'on',pr['prefill_worker'],'lcp blk',lcp(reqs[prev].blocks,q.blocks),'cands',c,'ttft %.2f'%(r['ttft_s']/3))
