"""What every trace format reads into: sessions of requests with prefix-block ids.

* **Mooncake JSONL** and **Azure CSV** have no sessions: they read into one session whose
  request times are absolute arrivals (``Trace.timed = True``). Mooncake hash ids are global
  (``scope = None``); Azure has none (``hash_ids = None``: no prefix information at all).
* **Claude Code** reads one session per conversation; times are offsets from the
  conversation's start (``timed = False``: the arrival model chooses session starts). Hash ids
  are local to a conversation (``scope`` = conversation id), subagents keep their parent's
  scope (the trace numbers their blocks in the conversation's id space).

Block convention (``TraceRequest.blocks``): ``hash_ids`` name the full ``block_tokens``-token
blocks; Mooncake's last id names a partial block; a Claude Code prompt ends with
``input_tokens - block_tokens * len(hash_ids)`` tokens that have no id (new content that no other
request shares).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TraceRequest:
    """One request as the trace gives it (token counts in the trace's own tokens)."""

    t_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None
    source: str
    api_time_s: float | None = None
    think_time_s: float | None = None
    call_type: str = ""


@dataclass
class TraceSession:
    """A conversation: its requests in time order and the subagents it started.

    ``tool_tokens + system_tokens``: the leading part of every prompt that is the same for every
    user of the agent (tool definitions and system prompt); used by ``shared_prefix_fraction``.
    """

    id: str
    scope: str | None
    requests: list[TraceRequest]
    subagents: list["Subagent"] = field(default_factory=list)
    tool_tokens: int = 0
    system_tokens: int = 0
    role: str = "main"


@dataclass
class Subagent:
    """A nested agent started ``start_s`` after its parent's start; the parent waits for it.

    ``after_index``: index (in the parent's ``requests``) of the last parent request issued before
    the subagent started (-1: none)."""

    start_s: float
    after_index: int
    session: TraceSession


@dataclass
class Trace:
    """A whole trace: ``format`` (``mooncake`` | ``claude_code`` | ``azure``), the files read,
    the trace's block size, sessions, and whether it has prefix ids and absolute times."""

    format: str
    path: str
    block_tokens: int
    sessions: list[TraceSession]
    timed: bool
    has_prefix_info: bool
    files: int = 1

    def num_requests(self) -> int:
        """Requests including every subagent's."""
        def count(s: TraceSession) -> int:
            return len(s.requests) + sum(count(a.session) for a in s.subagents)
        return sum(count(s) for s in self.sessions)
