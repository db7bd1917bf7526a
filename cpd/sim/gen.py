"""``python -m cpd.sim.gen OUT.jsonl``: write a seeded synthetic coding-agent trace (Mooncake JSONL).

Mountable as a typer command (``app.command("gen-agent")(generate)``). The file replays
live with ``cpd bench`` (open loop: JSONL has no session links; pre-existing sessions of
``prewarm`` are not written, so a live run starts with them cold).
"""
from __future__ import annotations

from pathlib import Path

import typer


def generate(
    out: Path = typer.Argument(..., help="output JSONL path"),
    qps: float = typer.Option(2.0, help="mean arrival rate (requests/s)"),
    duration_s: float = typer.Option(600.0, help="trace length (s)"),
    ramp_s: float = typer.Option(0.0, help="linear ramp from 0 to qps (s)"),
    cold_fraction: float = typer.Option(0.03, help="probability that a request starts a new session"),
    first_context: int = typer.Option(100_000, help="new-session context (tokens)"),
    turn_suffix: int = typer.Option(2_000, help="tokens appended per turn"),
    output_tokens: int = typer.Option(200, help="mean output tokens"),
    seed: int = typer.Option(0, help="RNG seed"),
) -> None:
    """Generate sessions with long first contexts, short turns and cold arrivals (see AgentWorkload)."""
    from cpd.sim.workload import AgentWorkload, agent_workload, write_mooncake
    w = AgentWorkload(cold_fraction=cold_fraction, first_context=first_context, turn_suffix=turn_suffix,
                      output_tokens=output_tokens, prewarm=False)
    reqs, _ = agent_workload(w, qps, duration_s, ramp_s, seed)
    write_mooncake(reqs, out)
    cold = sum(1 for r in reqs if r.tag == "cold")
    typer.echo(f"wrote {len(reqs)} requests ({cold} cold) to {out}")


if __name__ == "__main__":
    typer.run(generate)
