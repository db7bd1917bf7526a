"""``make demo`` / ``cpd demo``: a local CPD deployment driven by a mixed warm/cold
multi-turn chat workload through the official ``openai`` client.

Prints one row per request (class, pool that served it, cached tokens, TTFT, TPOT)
and a summary, then stops every process.
"""
from __future__ import annotations

import time

import httpx
from rich.console import Console
from rich.table import Table

TOPICS = ["the history of the printing press", "how bridges carry loads", "the water cycle",
          "why the sky is blue", "how vaccines train the immune system", "the rules of chess"]
FILLER = ("Please answer carefully and in plain words. Keep in mind that the reader is curious but new to the "
          "subject, so explain each idea before using it, give one concrete example, and avoid jargon. ")


def _conversation_turns(topic: str) -> list[str]:
    # The topic comes first, so first turns share no prefix (cold); later turns extend the history (warm).
    return [f"Tell me about {topic}. {FILLER * 4}", "Can you give a concrete example?", "Summarise that in one line."]


def _stream_chat(client, model: str, messages: list[dict], max_tokens: int) -> tuple[str, str, float, float, int]:
    t0 = time.perf_counter()
    first = last = None
    n = 0
    text = []
    rid = ""
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        rid = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
            text.append(chunk.choices[0].delta.content)
    ttft = (first or time.perf_counter()) - t0
    tpot = (last - first) / (n - 1) if n > 1 and first is not None and last is not None else 0.0
    return rid, "".join(text), ttft, tpot, n


def run_demo(model_dir: str | None = None, max_tokens: int = 24) -> list[dict]:
    from openai import OpenAI

    from cpd.cli import _resolve_model
    from cpd.config import build_config
    from cpd.deploy import Deployment

    console = Console(width=120)
    cfg = build_config(overrides={"model.dir": _resolve_model(model_dir), "router.port": 0,
                                  "deployment.topology": "cpd", "deployment.num_pre_prefill": 1,
                                  "deployment.num_prefill": 1, "deployment.num_decode": 1})
    console.print(f"[bold]starting[/] router + {', '.join(cfg.deployment.roles())} (model {cfg.model.dir})")
    rows: list[dict] = []
    with Deployment(cfg) as dep:
        client = OpenAI(base_url=f"{dep.url}/v1", api_key="none")
        convs = {t: [{"role": "user", "content": _conversation_turns(t)[0]}] for t in TOPICS[:4]}
        schedule = [(t, 0) for t in TOPICS[:2]] + [(t, 1) for t in TOPICS[:2]] + [(t, 0) for t in TOPICS[2:4]] + \
                   [(t, 2) for t in TOPICS[:2]] + [(t, 1) for t in TOPICS[2:4]]
        for topic, turn in schedule:
            msgs = convs[topic]
            if turn > 0:
                msgs.append({"role": "user", "content": _conversation_turns(topic)[turn]})
            rid, text, ttft, tpot, n = _stream_chat(client, dep.model_name, msgs, max_tokens)
            msgs.append({"role": "assistant", "content": text})
            rec = httpx.get(f"{dep.url}/cpd/requests", timeout=5).json().get(rid, {})
            rows.append({"request": f"{topic.split()[-1]} turn {turn + 1}", "class": rec.get("class", "?"),
                         "pool": rec.get("pool", "?"), "prompt_tokens": rec.get("prompt_tokens", 0),
                         "cached_tokens": sum((rec.get("cached_tokens_by_tier") or {}).values()),
                         "tiers": rec.get("cached_tokens_by_tier", {}), "ttft_s": ttft, "tpot_s": tpot,
                         "output_tokens": n})
        _print(console, rows)
        leaks = {w: s for w, s in dep.pool_stats().items() if s.get("num_in_use", 0)}
        console.print("block pools back to baseline" if not leaks else f"[red]blocks still in use: {leaks}")
    console.print("[bold]stopped[/] all processes")
    return rows


def _print(console: Console, rows: list[dict]) -> None:
    t = Table(title="cpd demo: per-request results")
    for c in ("request", "class", "pool", "prompt", "cached", "tiers", "TTFT ms", "TPOT ms"):
        t.add_column(c)
    for r in rows:
        tiers = ",".join(f"{k}:{v}" for k, v in r["tiers"].items() if v) or "-"
        t.add_row(r["request"], r["class"], r["pool"], str(r["prompt_tokens"]), str(r["cached_tokens"]), tiers,
                  f"{r['ttft_s'] * 1e3:.0f}", f"{r['tpot_s'] * 1e3:.1f}")
    console.print(t)
    for cls in ("cold", "warm"):
        sel = [r for r in rows if r["class"] == cls]
        if sel:
            ttfts = sorted(r["ttft_s"] for r in sel)
            console.print(f"{cls}: {len(sel)} requests, TTFT median {ttfts[len(ttfts) // 2] * 1e3:.0f} ms, "
                          f"cached tokens {sum(r['cached_tokens'] for r in sel)} / "
                          f"{sum(r['prompt_tokens'] for r in sel)} prompt tokens")


if __name__ == "__main__":
    run_demo()
