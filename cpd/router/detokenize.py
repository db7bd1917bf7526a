"""Incremental detokenization and stop-string handling for streamed generation.

Two pieces, used together by :mod:`cpd.router.openai_front` for every request:

- :class:`IncrementalDetokenizer` turns token ids, as they arrive, into text deltas whose
  concatenation equals ``tokenizer.decode(all_ids, skip_special_tokens=True)`` and that never
  split a multi-byte UTF-8 character: bytes of an incomplete character are held back until
  the token that completes it arrives.

  * Byte-level BPE tokenizers (GPT-2 style, e.g. SmolLM2; detected from the ``tokenizers``
    decoder being ``ByteLevel``): each token maps to raw bytes via the inverse of the
    byte→unicode table of byte-level BPE; the bytes go through Python's incremental UTF-8
    decoder (``codecs``, ``errors="replace"``), which holds back exactly the bytes of an
    unfinished character and replaces invalid ones at once with U+FFFD. Cost: O(new tokens).
  * Any other tokenizer: re-decode a short window of tokens and emit the difference
    (text that ends in U+FFFD is held back, for at most ``max_hold`` tokens).

- :class:`StopStringMatcher` cuts output before the first occurrence of any stop string and
  holds back any text that might be the beginning of a stop string until it is resolved.
  OpenAI semantics ("The returned text will not contain the stop sequence", API reference,
  ``stop`` parameter).
"""
from __future__ import annotations

import codecs
import json
from typing import Any, Iterable, Sequence


def _byte_level_unicode_table() -> dict[str, int]:
    """Inverse of byte-level BPE's byte→printable-char table: char → byte value.

    Bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for
    themselves; the remaining 68 byte values are mapped, in increasing order, to
    ``chr(256 + k)``.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) \
        | set(range(0xAE, 0xFF + 1))
    table: dict[str, int] = {}
    k = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + k)] = b
            k += 1
    return table


_BYTE_OF_CHAR = _byte_level_unicode_table()


_NO_DECODER_ATTR = object()


def _is_byte_level(hf: Any) -> bool:
    """Is ``hf``'s ``tokenizers`` decoder ``ByteLevel``? Read from the decoder object (O(1));
    serialising the whole tokenizer to JSON to read one field took 0.26 s for SmolLM2's 1.5 MB
    tokenizer (more under load), which the first request of a router paid before it reached a
    worker (docs/results/modeled_ordering/README.md, "Session 12"). The JSON route stays for a
    backend without a ``decoder`` attribute."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return False
    dec_obj = getattr(backend, "decoder", _NO_DECODER_ATTR)
    if dec_obj is not _NO_DECODER_ATTR:
        return dec_obj is not None and type(dec_obj).__name__ == "ByteLevel"
    try:
        dec = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:
        return False
    return dec.get("type") == "ByteLevel"


class _ByteTable:
    """Lazily filled id → bytes map for a byte-level BPE tokenizer (``b""`` for special
    tokens, verbatim UTF-8 for added non-special tokens)."""

    def __init__(self, tok: Any):
        self._tok = tok
        hf = tok.hf
        self._special = tok.special_ids
        self._added: dict[int, str] = {}
        try:
            for i, t in (getattr(hf, "added_tokens_decoder", None) or {}).items():
                self._added[int(i)] = getattr(t, "content", str(t))
        except Exception:
            pass
        self._cache: dict[int, bytes] = {}

    def get(self, ids: Sequence[int]) -> bytes:
        cache = self._cache
        missing = [i for i in ids if i not in cache]
        if missing:
            toks = self._tok.convert_ids_to_tokens(missing)
            for i, s in zip(missing, toks):
                if i in self._special:
                    cache[i] = b""
                elif i in self._added:
                    cache[i] = self._added[i].encode("utf-8")
                elif s is None:
                    cache[i] = b""
                else:
                    out = bytearray()
                    for ch in s:
                        b = _BYTE_OF_CHAR.get(ch)
                        if b is None:
                            out += ch.encode("utf-8")
                        else:
                            out.append(b)
                    cache[i] = bytes(out)
        return b"".join(cache[i] for i in ids)


def _byte_table_for(tok: Any) -> _ByteTable | None:
    """The (shared, per tokenizer) byte table, or ``None`` if the tokenizer is not
    byte-level BPE."""
    cached: Any = getattr(tok, "_cpd_byte_table", False)  # _ByteTable | None once computed
    if cached is not False:
        return cached
    table = _ByteTable(tok) if _is_byte_level(tok.hf) else None
    try:
        tok._cpd_byte_table = table
    except AttributeError:
        pass
    return table


def prepare_detokenizer(tokenizer: Any) -> None:
    """Do the per-tokenizer work of :class:`IncrementalDetokenizer` now (the byte-level check and
    its shared byte table) rather than in the first request; the router calls it at start-up."""
    _byte_table_for(tokenizer)


class IncrementalDetokenizer:
    """Token ids in, UTF-8-safe text deltas out.

    ``tokenizer`` is a :class:`cpd.router.tokenization.Tokenizer`. Special tokens (EOS...)
    produce no text. Usage::

        d = IncrementalDetokenizer(tok)
        for ids in chunks: send(d.push(ids))
        send(d.flush())        # at the end: releases held bytes (as U+FFFD if incomplete)

    ``force_generic=True`` selects the re-decode path even for byte-level tokenizers.
    """

    def __init__(self, tokenizer: Any, force_generic: bool = False, max_hold: int = 6):
        self._tok = tokenizer
        self._table = None if force_generic else _byte_table_for(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # generic path state: text of ids[_ctx:] is re-decoded; its first _out chars are sent
        self._ids: list[int] = []
        self._ctx = 0
        self._out = 0
        self._clean = 0      # len(ids) at the last point whose text ended on a whole char
        self._progress = 0   # len(ids) when text last advanced
        self._max_hold = max_hold
        self.num_tokens = 0

    def push(self, token_ids: Iterable[int]) -> str:
        """Feed newly generated ids; return the text that is now final (maybe "")."""
        ids = list(token_ids)
        self.num_tokens += len(ids)
        if not ids:
            return ""
        if self._table is not None:
            return self._utf8.decode(self._table.get(ids))
        self._ids.extend(ids)
        return self._generic(final=False)

    def flush(self) -> str:
        """Return whatever is held back (the stream has ended)."""
        if self._table is not None:
            return self._utf8.decode(b"", final=True)
        if not self._ids:
            return ""
        return self._generic(final=True)

    def _generic(self, final: bool) -> str:
        ids = self._ids
        text = self._tok.decode(ids[self._ctx:])
        end = len(text)
        if not final:
            while end > self._out and text[end - 1] == "\ufffd":
                end -= 1   # possibly an unfinished character: hold it back
            if end < len(text) and len(ids) - self._progress > self._max_hold:
                end = len(text)   # no progress for too long: a genuinely invalid sequence
        delta = text[self._out:end] if end > self._out else ""
        if end > self._out:
            self._progress = len(ids)
        self._out = max(self._out, end)
        if end == len(text):
            # whole characters only: slide the window so decoding stays O(new tokens)
            self._ctx = self._clean
            self._clean = len(ids)
            self._out = len(self._tok.decode(ids[self._ctx:]))
        return delta


class StopStringMatcher:
    """Cuts a text stream before the first stop string.

    ``stops``: the stop strings (non-empty). :meth:`feed` takes the next text delta and
    returns ``(safe_text, stopped)``: ``safe_text`` may be sent to the client now; once
    ``stopped`` is true the stream is over and the stop string (and anything after it) is
    dropped. Text that is a prefix of some stop string is held back until the next delta
    resolves it; :meth:`flush` releases it when the stream ends without a stop.

    Invariant: no stop string can start inside already-released text, so only the held
    text needs to be searched.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        best = -1
        for s in self.stops:
            i = buf.find(s)
            if i != -1 and (best == -1 or i < best):
                best, self.matched = i, s
        if best != -1:
            self._held = ""
            self.stopped = True
            return buf[:best], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        if hold:
            self._held = buf[-hold:]
            return buf[:-hold], False
        self._held = ""
        return buf, False

    def flush(self) -> str:
        """Release held text at end of stream (no stop string matched)."""
        out, self._held = self._held, ""
        return "" if self.stopped else out


__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "prepare_detokenizer"]
