"""First-request router delay: ttft_s - worker_prefill_s per request (wall), a modeled pd-l3 deployment."""
import sys, time, tempfile, json
from pathlib import Path
import httpx
sys.path.insert(0, "tests")
from cpd.engine.weights import make_tiny_llama_dir
from deploy_util import start, complete, routing_record, random_prompt

K = 3.0
S = {"engine.executor": "modeled", "engine.hardware": "h100", "engine.model_shape": "llama-3.1-70b", "engine.tp": 1,
     "engine.time_dilation": K, "engine.max_num_batched_tokens": 2048, "engine.max_prefill_chunk_tokens": 2048,
     "engine.block_size": 64, "engine.num_blocks": 1024, "handoff.arena_bytes": 64 << 20}
tmp = Path(tempfile.mkdtemp())
md = str(make_tiny_llama_dir(tmp / "tiny", seed=0))
t = time.monotonic()
dep = start(md, "pd", kv_store=f"file://{tmp/'l3'}", num_prefill=2, num_decode=1, settings=S)
print("startup_s", round(time.monotonic() - t, 2), flush=True)
try:
    with httpx.Client(timeout=60) as cl:
        cl.get(f"{dep.url}/v1/models")
        time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.5)
        for i in range(6):
            p = random_prompt(10 + i, 256)
            body = {"model": dep.model_name, "prompt": p, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter(); rid = None; t_first = None; print("send", i, f"{time.monotonic():.4f}", flush=True)
            with cl.stream("POST", f"{dep.url}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        c = json.loads(line[5:]); rid = rid or c.get("id")
                        if t_first is None and c.get("choices"): t_first = time.perf_counter() - t0
            rec = routing_record(dep, rid)
            out = rec["ttft_s"] - rec["worker_prefill_s"]
            print(f"req {i}: client first chunk {t_first:.3f} s, ttft {rec['ttft_s']:.3f}, worker_prefill {rec['worker_prefill_s']:.3f}, "
                  f"queue {rec['worker_queue_s']:.3f}, outside {out:.3f} s wall ({out / K:.3f} modeled)", flush=True)
finally:
    dep.stop()
