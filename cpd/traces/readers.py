"""Readers for every trace format, with format detection.

``read_trace(path)`` picks the reader from the content: a folder (or a ``trace_*.json[.gz]``
file) holding JSON objects with ``"requests"`` is Claude Code; a file whose lines are JSON
objects with ``"timestamp"`` is Mooncake JSONL; a CSV whose header is
``TIMESTAMP,ContextTokens,GeneratedTokens`` is the Azure 2023 trace. Anything else, and any
malformed line or request, raises :class:`TraceFormatError` naming the file, the line (or the
request's position) and what was expected. gzip is read transparently (``.gz``).

The formats are described in ``shared/data/traces/README.md``.
"""
from __future__ import annotations

import gzip
import io
import json
import math
import zlib
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

from .errors import TraceFormatError, shorten
from .model import Subagent, Trace, TraceRequest, TraceSession

MOONCAKE_BLOCK = 512
AZURE_BLOCK = 512
_MOONCAKE_EXPECT = 'a JSON object {"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}'
_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_all(path: Path) -> str:
    try:
        with _open_text(path) as f:
            return f.read()
    except (EOFError, OSError, zlib.error) as e:
        raise TraceFormatError(str(path), None, "a complete gzip file" if path.name.endswith(".gz")
                               else "a readable text file", f"{type(e).__name__}: {e}") from None
    except UnicodeDecodeError as e:
        raise TraceFormatError(str(path), None, "UTF-8 text", f"undecodable byte at offset {e.start}") from None


def claude_code_files(path: Path) -> list[Path]:
    """The ``trace_*.json`` / ``trace_*.json.gz`` files of a Claude Code folder, sorted by name."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.startswith("trace_")
                   and (p.name.endswith(".json") or p.name.endswith(".json.gz")))
    if not files:
        raise TraceFormatError(str(path), None, "a folder holding Claude Code trace_*.json[.gz] files",
                               "no such file")
    return files


def detect_format(path: str | Path) -> str:
    """``"claude_code"``, ``"mooncake"`` or ``"azure"`` from the content (raises TraceFormatError)."""
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(str(p), None, "an existing trace file or folder", "no such path")
    if p.is_dir():
        claude_code_files(p)
        return "claude_code"
    head = _head(p)
    first = head.lstrip()
    if not first:
        raise TraceFormatError(str(p), 1, "a trace (Mooncake JSONL, Claude Code JSON or Azure CSV)", "an empty file")
    line1 = first.splitlines()[0].strip()
    if tuple(c.strip() for c in line1.split(",")) == _AZURE_HEADER:
        return "azure"
    if first.startswith("{"):
        # a Claude Code conversation is one (usually multi-line or very long) object with "requests"
        if '"requests"' in head[:4096] or p.name.startswith("trace_"):
            return "claude_code"
        return "mooncake"
    raise TraceFormatError(
        str(p), 1, "Mooncake JSONL (" + _MOONCAKE_EXPECT + "), Claude Code JSON ({\"requests\": [...]}) "
        "or Azure CSV (header TIMESTAMP,ContextTokens,GeneratedTokens)", shorten(line1))


def _head(p: Path, n: int = 65536) -> str:
    try:
        with _open_text(p) as f:
            return f.read(n)
    except (EOFError, OSError, zlib.error) as e:
        raise TraceFormatError(str(p), None, "a complete gzip file" if p.name.endswith(".gz")
                               else "a readable file", f"{type(e).__name__}: {e}") from None
    except UnicodeDecodeError:
        raise TraceFormatError(str(p), None, "a text trace (Mooncake JSONL, Claude Code JSON or Azure CSV)",
                               "binary data") from None


def read_trace(path: str | Path, fmt: str | None = None, *, max_sessions: int | None = None) -> Trace:
    """Read any supported trace (format detected unless ``fmt`` is given)."""
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        return read_mooncake(path)
    if fmt == "claude_code":
        return read_claude_code(path, max_sessions=max_sessions)
    if fmt == "azure":
        return read_azure(path)
    raise ValueError(f"unknown trace format {fmt!r} (mooncake | claude_code | azure)")


# -- Mooncake -----------------------------------------------------------------------------------

def _int_field(d: dict, key: str, path: str, where: Any, expect: str, minimum: int = 0) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < minimum:
        raise TraceFormatError(path, where, f'"{key}" an integer >= {minimum} in {expect}', shorten(v))
    return int(v)


def _id_list(d: dict, key: str, path: str, where: Any, expect: str) -> tuple[int, ...]:
    v = d.get(key)
    if not isinstance(v, list) or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in v):
        raise TraceFormatError(path, where, f'"{key}" a list of integers >= 0 in {expect}', shorten(v))
    return tuple(v)


def iter_mooncake_rows(path: str | Path) -> Iterator[tuple[int, TraceRequest]]:
    """``(1-based line, request)`` per non-blank line; ``t_s`` is ``timestamp / 1000``."""
    p = str(path)
    try:
        f = _open_text(Path(path))
        with f:
            prev = -math.inf
            for lineno, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    d = json.loads(text)
                except ValueError:
                    raise TraceFormatError(p, lineno, _MOONCAKE_EXPECT, shorten(text)) from None
                if not isinstance(d, dict):
                    raise TraceFormatError(p, lineno, _MOONCAKE_EXPECT, shorten(text))
                ts = d.get("timestamp")
                if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                    raise TraceFormatError(p, lineno, '"timestamp" a number of milliseconds', shorten(ts))
                if ts < prev:
                    raise TraceFormatError(p, lineno, f"non-decreasing timestamps (previous {prev:g})", f"{ts:g}")
                prev = ts
                n_in = _int_field(d, "input_length", p, lineno, "a Mooncake row", 1)
                n_out = _int_field(d, "output_length", p, lineno, "a Mooncake row", 0)
                ids = _id_list(d, "hash_ids", p, lineno, "a Mooncake row")
                last = n_in - MOONCAKE_BLOCK * (len(ids) - 1)
                if not ids or not 0 < last <= MOONCAKE_BLOCK:
                    raise TraceFormatError(p, lineno, f"ceil(input_length / {MOONCAKE_BLOCK}) hash ids "
                                           f"({math.ceil(n_in / MOONCAKE_BLOCK)})", f"{len(ids)} for {n_in} tokens")
                yield lineno, TraceRequest(float(ts) / 1000.0, n_in, n_out, ids, f"{p}:{lineno}")
    except (EOFError, OSError, zlib.error) as e:
        raise TraceFormatError(p, None, "a complete, readable file", f"{type(e).__name__}: {e}") from None


def read_mooncake(path: str | Path) -> Trace:
    """Mooncake JSONL: one session, absolute arrivals, global 512-token prefix-hash ids."""
    reqs = [r for _, r in iter_mooncake_rows(path)]
    return Trace("mooncake", str(path), MOONCAKE_BLOCK, [TraceSession("trace", None, reqs)],
                 timed=True, has_prefix_info=True)


# -- Azure --------------------------------------------------------------------------------------

def read_azure(path: str | Path) -> Trace:
    """Azure 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``): arrivals and lengths only.

    There is **no prefix information**: ``hash_ids`` is None and every request is new content
    unless the replay options model a shared prefix explicitly (``azure_prefix_tokens``).
    """
    p = str(path)
    text = _read_all(Path(path))
    lines = text.splitlines()
    if not lines or tuple(c.strip() for c in lines[0].split(",")) != _AZURE_HEADER:
        raise TraceFormatError(p, 1, "the header TIMESTAMP,ContextTokens,GeneratedTokens",
                               shorten(lines[0] if lines else ""))
    reqs: list[TraceRequest] = []
    t0 = None
    for lineno, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        parts = [c.strip() for c in line.split(",")]
        expect = "TIMESTAMP (YYYY-MM-DD HH:MM:SS[.fraction]),ContextTokens (int >= 1),GeneratedTokens (int >= 0)"
        if len(parts) != 3:
            raise TraceFormatError(p, lineno, expect, shorten(line))
        try:
            ts = _azure_time(parts[0])
            n_in, n_out = int(parts[1]), int(parts[2])
        except ValueError:
            raise TraceFormatError(p, lineno, expect, shorten(line)) from None
        if n_in < 1 or n_out < 0:
            raise TraceFormatError(p, lineno, expect, shorten(line))
        t0 = ts if t0 is None else t0
        if ts < t0 or (reqs and ts - t0 < reqs[-1].t_s):
            raise TraceFormatError(p, lineno, "non-decreasing timestamps", parts[0])
        reqs.append(TraceRequest(ts - t0, n_in, n_out, None, f"{p}:{lineno}"))
    return Trace("azure", p, AZURE_BLOCK, [TraceSession("trace", None, reqs)], timed=True, has_prefix_info=False)


def _azure_time(s: str) -> float:
    """Seconds since the epoch (UTC-naive) of ``2023-11-16 18:17:03.9799600`` (100 ns digits)."""
    main, _, frac = s.partition(".")
    base = datetime.strptime(main, "%Y-%m-%d %H:%M:%S").timestamp()
    if frac and not frac.isdigit():
        raise ValueError(s)
    return base + (float("0." + frac) if frac else 0.0)


# -- Claude Code --------------------------------------------------------------------------------

_CC_EXPECT = 'a Claude Code conversation {"id", "block_size", "tool_tokens", "system_tokens", "requests": [...]}'


def read_claude_code(path: str | Path, *, max_sessions: int | None = None) -> Trace:
    """A folder of ``trace_*.json[.gz]`` conversations, or one such file."""
    p = Path(path)
    files = claude_code_files(p) if p.is_dir() else [p]
    if max_sessions is not None:
        files = files[:max_sessions]
    sessions = [_conversation(f) for f in files]
    blocks = {s[1] for s in sessions}
    if len(blocks) != 1:
        raise TraceFormatError(str(p), None, "one block_size for every conversation", str(sorted(blocks)))
    return Trace("claude_code", str(p), blocks.pop(), [s[0] for s in sessions], timed=False,
                 has_prefix_info=True, files=len(files))


def _conversation(f: Path) -> tuple[TraceSession, int]:
    text = _read_all(f)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(str(f), e.lineno, _CC_EXPECT, f"invalid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(d, dict) or not isinstance(d.get("requests"), list):
        raise TraceFormatError(str(f), 1, _CC_EXPECT, shorten(text))
    bs = _int_field(d, "block_size", str(f), "block_size", "a conversation", 1)
    cid = str(d.get("id") or f.name.split(".")[0])
    scope = cid if d.get("hash_id_scope", "local") == "local" else None
    sess = _session(d, str(f), "", cid, scope, bs, "main")
    return sess, bs


def _session(d: dict, path: str, where: str, sid: str, scope: str | None, bs: int, role: str) -> TraceSession:
    tool = _int_field(d, "tool_tokens", path, where + "tool_tokens", "a conversation") if "tool_tokens" in d else 0
    system = _int_field(d, "system_tokens", path, where + "system_tokens", "a conversation") if "system_tokens" in d else 0
    sess = TraceSession(sid, scope, [], [], tool, system, role)
    prev_t = -math.inf
    for i, r in enumerate(d["requests"]):
        at = f"{where}requests[{i}]"
        if not isinstance(r, dict):
            raise TraceFormatError(path, at, "a request object", shorten(r))
        t = r.get("t")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise TraceFormatError(path, at + ".t", "seconds >= 0 from the conversation's start", shorten(t))
        if t < prev_t:
            raise TraceFormatError(path, at + ".t", f"non-decreasing times (previous {prev_t:g})", f"{t:g}")
        prev_t = t
        if r.get("type") == "subagent":
            if not isinstance(r.get("requests"), list):
                raise TraceFormatError(path, at, 'a subagent with "requests": [...]', shorten(r))
            kind = str(r.get("subagent_type") or "subagent")
            sub = _session(r, path, at + ".", f"{sid}/{r.get('agent_id', i)}", scope, bs, kind)
            sess.subagents.append(Subagent(float(t), len(sess.requests) - 1, sub))
            continue
        if r.get("type") not in ("s", "n"):
            raise TraceFormatError(path, at + ".type", '"s", "n" or "subagent"', shorten(r.get("type")))
        n_in = _int_field(r, "in", path, at, "a request", 1)
        n_out = _int_field(r, "out", path, at, "a request", 0)
        ids = _id_list(r, "hash_ids", path, at, "a request")
        if len(ids) != n_in // bs:
            raise TraceFormatError(path, at + ".hash_ids", f"floor(in / {bs}) = {n_in // bs} ids (one per full block)",
                                   f"{len(ids)}")
        sess.requests.append(TraceRequest(float(t), n_in, n_out, ids, f"{path}#{at}",
                                          _opt_float(r, "api_time"), _opt_float(r, "think_time"), r["type"]))
    return sess


def _opt_float(r: dict, key: str) -> float | None:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 else None
