"""The live router's own wall time per request, by stage, with long prompts (issue 13: "router
decision", "warm TTFT outside model compute").

A real deployment of modeled workers (``engine.executor = modeled``: no model compute beyond a
dilated sleep, ``--time-dilation``) is started with :class:`cpd.deploy.Deployment`; next to its
own router this benchmark starts one *instrumented* router process per ``--variant NAME=TREE``
(the router code of source tree ``TREE``: e.g. a ``git archive`` of the commit before a change,
and the working tree), each on the deployment's ``router.toml`` (same workers, same KV events).
The client sends, interleaved over the variants (order shuffled per round, a fresh random prompt
per request), non-streaming requests:

* ``ids``:  ``POST /v1/completions`` with ``prompt`` = N token ids;
* ``chat``: ``POST /v1/chat/completions`` with one user message of text that tokenizes to ~N tokens;
* ``chat_turn``: a session's next turn: the previous ``chat_turn`` request's messages (of this
  variant and length) + an assistant answer and a new user message of ~1K tokens each, the
  oldest messages after the first dropped to stay at ~N tokens (the warm-up round starts each
  session with ~N − 2K tokens of ~2K-token messages).

``max_tokens = 2``: a prefill with handoff, then one decoded token. The instrumented router wraps
its own functions (by module attribute, when the tree has them) with timers and answers
``GET /bench/stages`` with the last request's figures (ms):

==================  ==========================================================================
stage               what
==================  ==========================================================================
body_read           reading the request body from the ASGI server (``read_limited``)
json_parse          ``parse_json_object`` (JSON decode + nesting/Unicode checks)
validate            the rest of ``OpenAIFront._prepare``: union-field checks, the request model,
                    token id range, context checks
tokenize            chat template + tokenizer (``apply_chat_template`` / ``encode_prompt``)
hash                block hashing (``hash_blocks`` in ``cpd.router.dispatch``)
match_route         the rest of ``CPDBackend._decide``: index match, snapshots, policy
prefill_encode      JSON of the ``PrefillRequest`` (``encode`` in ``prefill_relay``)
prefill_decode      decoding the prefill's NDJSON lines (``decode_body`` in ``prefill_relay``)
l3_observe          applying the answer's L3 observations to the index (``_correct_stale_index``)
pending_writes      announcing a write-through's blocks as pending L3 writes (``add_pending_writes``)
answer_bytes        size of the prefill answer line (bytes, not ms); ``l3_observed_hashes``: block
                    hashes in its L3 observations (count, not ms)
decode_encode       JSON of the ``DecodeRequest`` (``encode`` in ``decode_relay``)
decode_lines        decoding the decode stream's lines (``decode_body`` in ``decode_relay``)
detokenize          ``TextState.on_chunk`` / ``on_end``
response            building the JSON response (``JSONResponse`` in the front)
prefill_wait        in ``post_prefill`` minus its encode/decode: the prefill worker's answer
                    (``worker_prefill``: the worker's own ``prefill_s``) + HTTP both ways
decode_wait         in ``relay_decode`` minus its encode/decode: the decode worker + HTTP
handle              the whole ``OpenAIFront.handle`` (body read to response object)
router_own          ``handle`` − ``prefill_wait`` − ``decode_wait``: the router's own time
                    (its HTTP client's work inside the waits is not in it)
router_cpu          CPU time of the router process (all threads) during ``handle``: its work
                    whatever the machine's load (its HTTP client's included)
events_cpu          of which its KV-event thread (decoding the workers' events, updating the
                    prefix index: not on the request's path, but it holds the GIL meanwhile)
router_cpu_no_events  ``router_cpu`` − ``events_cpu``: the request's own CPU (event loop, its
                    HTTP client, parse/tokenize threads), plus the loop's background tasks
client_wall         the client's wall time (its JSON encoding of the body excluded)
==================  ==========================================================================

Medians over ``--reps`` rounds. The 1-minute load average is sampled before and after.

``--components`` instead times, in this process, the token-id path's own steps (parse, checks,
request model, hash, index match, prefill request JSON, pending writes, answer decode, L3
observations, decode request JSON; min over ``--reps``): the router's computation on a request's
path without HTTP, other requests or the KV-event thread, the figure least disturbed by a
loaded machine. Run it once per tree (``PYTHONPATH=TREE``).

Usage::

    PYTHONPATH=. nice -n 19 .venv/bin/python benchmarks/bench_router_request.py \\
        --variant before=sim_out/router_before --variant after=. \\
        [--lengths 2048,32768,131000] [--apis ids,chat,chat_turn] [--reps 5] [--json out.json] [--py-spy DIR]
    PYTHONPATH=TREE .venv/bin/python benchmarks/bench_router_request.py --components --reps 15
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent

STAGES = ("body_read", "json_parse", "validate", "tokenize", "hash", "match_route", "prefill_encode",
          "prefill_decode", "l3_observe", "pending_writes", "answer_bytes", "l3_observed_hashes", "decode_encode", "decode_lines", "detokenize", "response", "prefill_wait",
          "worker_prefill", "decode_wait", "handle", "router_own", "router_cpu", "events_cpu", "router_cpu_no_events",
          "client_wall")


# --------------------------------------------------------------------------- instrumented router
def _serve_router(config: str, port: int) -> None:
    """Run the router of ``config`` on ``port`` with stage timers (module docstring)."""
    import asyncio
    import functools

    import uvicorn

    from cpd.config import build_config
    from cpd.router import decode_relay, dispatch, prefill_relay, request_body
    from cpd.router.main import build_router
    from cpd.router.openai_front import front as front_mod
    from cpd.router.openai_front import text_state
    from cpd.router.tokenization import Tokenizer

    acc: dict[str, float] = collections.defaultdict(float)
    last: dict[str, float] = {}
    pc = time.perf_counter

    def timed(name, fn):
        if asyncio.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def aw(*a, **k):
                t0 = pc()
                try:
                    return await fn(*a, **k)
                finally:
                    acc[name] += pc() - t0
            return aw

        @functools.wraps(fn)
        def w(*a, **k):
            t0 = pc()
            try:
                return fn(*a, **k)
            finally:
                acc[name] += pc() - t0
        return w

    def patch(obj, attr, name):
        if hasattr(obj, attr):
            setattr(obj, attr, timed(name, getattr(obj, attr)))

    patch(request_body, "read_limited", "body_read")
    patch(request_body, "parse_json_object", "json_parse")
    patch(front_mod.OpenAIFront, "_prepare", "prepare")
    patch(Tokenizer, "encode_prompt", "tokenize")
    patch(Tokenizer, "apply_chat_template", "tokenize")
    patch(dispatch, "hash_blocks", "hash")
    patch(dispatch.CPDBackend, "_decide", "decide")
    patch(prefill_relay, "encode", "prefill_encode")
    patch(decode_relay, "encode", "decode_encode")
    patch(decode_relay, "decode_body", "decode_lines")
    patch(dispatch, "post_prefill", "prefill_call")
    patch(dispatch.CPDBackend, "_correct_stale_index", "l3_observe")
    patch(dispatch.PrefixIndex, "add_pending_writes", "pending_writes")
    patch(text_state.TextState, "on_chunk", "detokenize")
    patch(text_state.TextState, "on_end", "detokenize")

    orig_pdecode = prefill_relay.decode_body

    def prefill_decode(data, typ):
        t0 = pc()
        try:
            msg = orig_pdecode(data, typ)
        finally:
            acc["prefill_decode"] += pc() - t0
        ans = getattr(msg, "answer", None)
        if ans is not None:
            acc["worker_prefill"] += ans.prefill_s
            acc["answer_bytes"] += len(data) / 1e3  # shown x 1e3: bytes
            acc["l3_observed_hashes"] += sum(len(o.block_hashes) for o in ans.l3_observations) / 1e3
        return msg
    prefill_relay.decode_body = prefill_decode

    orig_relay = dispatch.relay_decode

    async def relay_decode(*a, **k):
        agen = orig_relay(*a, **k)
        try:
            while True:
                t0 = pc()
                try:
                    x = await agen.__anext__()
                except StopAsyncIteration:
                    return
                finally:
                    acc["decode_call"] += pc() - t0
                yield x
        finally:
            await agen.aclose()
    dispatch.relay_decode = relay_decode

    orig_json_response = front_mod.JSONResponse

    class TimedJSONResponse(orig_json_response):  # type: ignore[misc,valid-type]
        def __init__(self, *a, **k):
            t0 = pc()
            try:
                super().__init__(*a, **k)
            finally:
                acc["response"] += pc() - t0
    front_mod.JSONResponse = TimedJSONResponse

    orig_handle = front_mod.OpenAIFront.handle

    def events_cpu_s() -> float:
        """CPU time of the router's KV-event thread so far (0 if it is not found)."""
        import threading
        for t in threading.enumerate():
            if t.name == "kv-event-sub" and t.ident is not None:
                try:
                    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                except (OSError, ProcessLookupError):
                    return 0.0
        return 0.0

    async def handle(self, request, chat):
        acc.clear()
        t0, c0, e0 = pc(), time.process_time(), events_cpu_s()
        try:
            return await orig_handle(self, request, chat)
        finally:
            acc["handle"] += pc() - t0
            acc["router_cpu"] += time.process_time() - c0
            acc["events_cpu"] += events_cpu_s() - e0
            ms = {k: v * 1e3 for k, v in acc.items()}
            g = ms.get
            out = {k: g(k, 0.0) for k in ("body_read", "json_parse", "tokenize", "hash", "prefill_encode",
                                          "prefill_decode", "decode_encode", "decode_lines", "detokenize",
                                          "response", "worker_prefill", "handle", "router_cpu", "l3_observe",
                                          "pending_writes", "answer_bytes", "l3_observed_hashes", "events_cpu")}
            out["router_cpu_no_events"] = out["router_cpu"] - out["events_cpu"]
            out["validate"] = g("prepare", 0.0) - g("body_read", 0.0) - g("json_parse", 0.0) - g("tokenize", 0.0)
            out["match_route"] = g("decide", 0.0) - g("hash", 0.0)
            out["prefill_wait"] = g("prefill_call", 0.0) - g("prefill_encode", 0.0) - g("prefill_decode", 0.0)
            out["decode_wait"] = g("decode_call", 0.0) - g("decode_encode", 0.0) - g("decode_lines", 0.0)
            out["router_own"] = out["handle"] - out["prefill_wait"] - out["decode_wait"]
            last.clear()
            last.update(out)
    front_mod.OpenAIFront.handle = handle

    cfg = build_config(config, {"router.port": port})
    router = build_router(cfg)
    app = router.app()

    @app.get("/bench/stages")
    async def stages():
        return dict(last)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --------------------------------------------------------------------------- components in-process
def _components(lengths: list[int], reps: int) -> dict:
    """The token-id path's own steps for one request, in this process, in order (this tree's router
    code; min over ``reps``, ms): what the router computes on a request's path, without HTTP, other
    requests or the KV-event thread. The prefill answer is the tree's worker's (before issue 13's
    last change: the prompt echoed in ``token_ids``) with two L3 observations of every block hash
    (probe and write-through)."""
    import json as _json

    from cpd.kv.block_hash import Namespace, hash_blocks
    from cpd.messages.handoff import HandoffHandle
    from cpd.messages.sampling import SamplingParams
    from cpd.messages.worker_api import (DecodeRequest, L3Observation, PrefillLine, PrefillRequest,
                                         PrefillResponse, decode_body, encode)
    from cpd.router.index import PrefixIndex
    from cpd.router.openai_front import validation as v
    from cpd.router.openai_front.models import CompletionRequest
    from cpd.router.request_body import parse_json_object

    answer_type = getattr(__import__("cpd.messages.worker_api", fromlist=["x"]), "PrefillAnswerLine", PrefillLine)
    rng = random.Random(0)
    ns = Namespace(model_id="bench", weights_digest="w", tokenizer_digest="t")
    out: dict = {"answer_type": answer_type.__name__}
    for n in lengths:
        ids = [rng.randrange(10, 49000) for _ in range(n)]
        body = _json.dumps({"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}).encode()
        hs = hash_blocks(ids, ns)
        idx = PrefixIndex()
        chunk_ends = [(int(hs[i + 15]), 16) for i in range(0, len(hs) - 15, 16)]
        handle = HandoffHandle(kind="tcp", host="h", port=1, request_id="r", nbytes=1, dtype="<f4", shape=(1,),
                               host_id="x", generation=1, checksum=0, reclaim_after_s=30.0)
        echo = {"token_ids": ids + [7]} if "token_ids" in PrefillResponse.__struct_fields__ else {}  # before
        ans = PrefillResponse(first_token_ids=[7], finish_reason=None, prefill_s=1.0, handoff=handle, kv_bytes=1,
                              **echo, l3_observations=[
                                  L3Observation(block_hashes=list(hs), present=[], offset_s=0.0),
                                  L3Observation(block_hashes=list(hs), present=chunk_ends, offset_s=0.5)])
        answer_line = encode(PrefillLine(answer=ans))
        sampling = SamplingParams(max_tokens=2)
        steps: dict[str, Callable[[], object]] = {}
        state: dict = {}
        steps["json_parse"] = lambda: state.__setitem__("obj", parse_json_object(body))
        steps["union_checks"] = lambda: state.__setitem__("prompt", v.check_union_fields(state["obj"], False))

        def model():
            stand_in = getattr(v, "without_token_prompt", None)
            bounds = v.token_range(state["prompt"]) if hasattr(v, "token_range") else None
            state["bounds"] = bounds
            CompletionRequest.model_validate(stand_in(state["obj"], state["prompt"], bounds) if stand_in
                                             else state["obj"])
        steps["request_model"] = model

        def vocab():  # as the tree's front does it
            if state["prompt"] is None:  # before: single_prompt again, then a Python loop over the ids
                p = list(v.single_prompt(state["obj"]["prompt"]))
                for i, t in enumerate(p):
                    if not 0 <= t < 49152:
                        raise AssertionError(i)
                return
            p = list(state["prompt"])
            lo, hi = state["bounds"] or (min(p), max(p))
            assert 0 <= lo and hi < 49152
        steps["vocab_check"] = vocab
        steps["hash"] = lambda: hash_blocks(ids, ns)
        steps["index_match"] = lambda: idx.match(hs, l3_max_blocks=(n - 1) // 16)
        steps["prefill_encode"] = lambda: encode(PrefillRequest(request_id="r", prompt_token_ids=ids,
                                                                sampling=sampling, stream_progress=True))
        steps["pending_writes"] = lambda: idx.add_pending_writes(hs, 1.0)
        steps["answer_decode"] = lambda: state.__setitem__("ans", decode_body(answer_line, answer_type).answer)
        steps["l3_observe"] = lambda: [idx.observe_l3(o.block_hashes, o.present, o.gone, since=o.offset_s)
                                       for o in state["ans"].l3_observations]
        steps["decode_encode"] = lambda: encode(DecodeRequest(request_id="r", token_ids=list(ids) + [7],
                                                              sampling=sampling, handoff=handle))
        best = {k: float("inf") for k in steps}
        for _ in range(reps):
            for k, f in steps.items():
                t0 = time.perf_counter()
                f()
                best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
        best = {k: round(x, 2) for k, x in best.items()}
        best["total"] = round(sum(best.values()), 2)
        out[str(n)] = best
    return out


# --------------------------------------------------------------------------- client side
def _words_text(rng: random.Random, n_words: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(2000)]
    return " ".join(rng.choice(words) for _ in range(n_words))


def _start_variants(variants: list[tuple[str, str]], router_toml: str, log_dir: Path) -> dict[str, tuple]:
    from cpd.deploy import free_port
    out = {}
    for name, tree in variants:
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), TOKENIZERS_PARALLELISM="false")
        log = open(log_dir / f"router-{name}.log", "w")
        p = subprocess.Popen([sys.executable, str(HERE), "--serve-router", router_toml, "--port", str(port)],
                             env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        out[name] = (p, f"http://127.0.0.1:{port}")
    return out


def _wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    import httpx
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router at {url} not healthy")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-router", default="", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--variant", action="append", default=[], help="NAME=SOURCE_TREE (repeatable; default now=.)")
    p.add_argument("--lengths", default="2048,32768,131000")
    p.add_argument("--apis", default="ids,chat,chat_turn")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--time-dilation", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    p.add_argument("--py-spy", default="", help="DIR: sample each variant's router with py-spy (collapsed "
                                                "stacks, all threads) into DIR/<variant>.txt")
    p.add_argument("--components", action="store_true", help="only the in-process steps of the token-id "
                   "path (of the tree on PYTHONPATH), min over --reps; printed as JSON")
    a = p.parse_args(argv)
    if a.serve_router:
        _serve_router(a.serve_router, a.port)
        return
    if a.components:
        print(json.dumps({"components_ms": _components([int(x) for x in a.lengths.split(",")], a.reps),
                          "load_avg": os.getloadavg()}, indent=1))
        return

    sys.path.insert(0, str(ROOT))
    import httpx

    from cpd.config import build_config
    from cpd.deploy import Deployment
    from cpd.engine.weights import make_tiny_llama_dir
    from cpd.router.tokenization import load_tokenizer

    variants = [tuple(v.split("=", 1)) for v in (a.variant or ["now=."])]
    lengths = [int(x) for x in a.lengths.split(",")]
    apis = a.apis.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-req-"))
    model_dir = str(make_tiny_llama_dir(tmp / "tiny-llama", seed=0))
    tok = load_tokenizer(model_dir)
    vocab = tok.vocab_size
    rng = random.Random(a.seed)
    # text per length: words calibrated on a sample (tokens per word of this generator)
    sample = _words_text(random.Random(1), 2000)
    tok_per_word = len(tok.encode_prompt(sample)) / 2000
    overrides = {"model.dir": model_dir, "router.port": 0, "deployment.supervise": False,
                 "router.routing_mode": "static", "engine.executor": "modeled", "engine.hardware": "b200",
                 "engine.model_shape": "llama-3.1-8b", "engine.tp": 4, "engine.time_dilation": a.time_dilation,
                 "engine.num_blocks": 40000, "kv.host_kv_bytes": 1 << 30, "handoff.arena_bytes": 64 << 20}
    load_before = os.getloadavg()
    rows: list[dict] = []
    with Deployment(build_config(overrides=overrides), log_dir=str(tmp / "logs")) as dep:
        router_toml = str(Path(dep._tmp) / "router.toml")
        procs = _start_variants(variants, router_toml, tmp / "logs")
        try:
            for _, url in procs.values():
                _wait_healthy(url)
            time.sleep(1.0)
            spies = []
            if a.py_spy:
                Path(a.py_spy).mkdir(parents=True, exist_ok=True)
                spy = str(Path(sys.executable).parent / "py-spy")
                spies = [subprocess.Popen([spy, "record", "--pid", str(proc.pid), "--rate", "250", "--threads",
                                           "--format", "raw", "-o", str(Path(a.py_spy) / f"{name}.txt")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                         for name, (proc, _) in procs.items()]
                time.sleep(1.0)
            client = httpx.Client(timeout=600)
            names = [n for n, _ in variants]
            sessions: dict[tuple[str, int], list[dict]] = {}  # chat_turn: (variant, length) -> messages so far
            for rep in range(-1, a.reps):  # rep -1: warm-up, not kept
                for n in lengths:
                    for api in apis:
                        order = names[:]
                        rng.shuffle(order)
                        for name in order:
                            url = procs[name][1]
                            if api == "chat_turn":
                                msgs = sessions.setdefault((name, n), [])  # [(role, text, ~tokens)]
                                if not msgs:  # a session's first turn: ~N - 2K tokens of ~2K-token messages
                                    while sum(m[2] for m in msgs) < int(0.96 * n) - 2048:
                                        k = min(2048, int(0.96 * n) - 2048 - sum(m[2] for m in msgs))
                                        msgs.append(("user" if len(msgs) % 2 == 0 else "assistant",
                                                     _words_text(rng, max(1, int(k / tok_per_word))), k))
                                for role in ("assistant", "user"):
                                    msgs.append((role, _words_text(rng, int(1024 / tok_per_word)), 1024))
                                while sum(m[2] for m in msgs) > 0.96 * n and len(msgs) > 3:
                                    del msgs[1]  # a sliding window: the oldest messages after the first go
                                body = {"messages": [{"role": r, "content": c} for r, c, _ in msgs],
                                        "max_tokens": 2, "temperature": 0, "ignore_eos": True}
                                path = "/v1/chat/completions"
                            elif api == "ids":
                                body = {"prompt": [rng.randrange(10, vocab - 10) for _ in range(n)],
                                        "max_tokens": 2, "temperature": 0, "ignore_eos": True}
                                path = "/v1/completions"
                            else:
                                text = _words_text(rng, int(n / tok_per_word * 0.97))
                                body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2,
                                        "temperature": 0, "ignore_eos": True}
                                path = "/v1/chat/completions"
                            raw = json.dumps(body).encode()
                            t0 = time.perf_counter()
                            r = client.post(url + path, content=raw, headers={"content-type": "application/json"})
                            wall_ms = (time.perf_counter() - t0) * 1e3
                            if r.status_code != 200:
                                raise RuntimeError(f"{name} {api} {n}: {r.status_code} {r.text[:300]}")
                            st = client.get(url + "/bench/stages").json()
                            st["client_wall"] = wall_ms
                            if rep >= 0:
                                rows.append({"variant": name, "api": api, "length": n, "rep": rep,
                                             "prompt_tokens": r.json()["usage"]["prompt_tokens"],
                                             "body_bytes": len(raw), **st})
                print(f"round {rep} done", file=sys.stderr, flush=True)
            for spy_proc in spies:
                spy_proc.send_signal(2)  # SIGINT: py-spy writes its file
                spy_proc.wait(timeout=60)
        finally:
            for proc, _ in procs.values():
                proc.terminate()
            for proc, _ in procs.values():
                proc.wait(timeout=20)
    load_after = os.getloadavg()
    summary: dict = {}
    for name, _ in variants:
        for api in apis:
            for n in lengths:
                sel = [r for r in rows if r["variant"] == name and r["api"] == api and r["length"] == n]
                if not sel:
                    continue
                summary.setdefault(name, {}).setdefault(api, {})[str(n)] = {
                    "prompt_tokens": int(statistics.median(r["prompt_tokens"] for r in sel)),
                    "body_bytes": int(statistics.median(r["body_bytes"] for r in sel)),
                    **{s: round(statistics.median(r.get(s, 0.0) for r in sel), 2) for s in STAGES}}
    out = {"variants": dict(variants), "lengths": lengths, "apis": apis, "reps": a.reps,
           "time_dilation": a.time_dilation, "load_avg_before": load_before, "load_avg_after": load_after,
           "medians_ms": summary, "rows": rows}
    print(json.dumps({"medians_ms": summary, "load_avg_before": load_before, "load_avg_after": load_after},
                     indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
