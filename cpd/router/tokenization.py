"""Prompt tokenization shared by the router and the workers.

The router must tokenize exactly as the engine does (docs/architecture.md, Router), so both load the
tokenizer through :func:`load_tokenizer` and turn text / chat messages into token ids with
the same two methods:

- :meth:`Tokenizer.encode_prompt` — a completions ``prompt`` string → ids
  (``add_special_tokens=True``: whatever the tokenizer adds, e.g. BOS; SmolLM2 adds none).
- :meth:`Tokenizer.apply_chat_template` — chat ``messages`` → ids: the model's chat template
  rendered with ``add_generation_prompt=True`` to text, then encoded with
  ``add_special_tokens=False`` (the template already writes the special tokens).

Source of the tokenizer: ``transformers.AutoTokenizer.from_pretrained(tokenizer_dir)``; the
directory is a Hugging Face tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``,
optionally ``chat_template.jinja``), e.g. the one ``save_pretrained`` writes after loading
SmolLM2's GGUF.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Hashable, Iterable, Mapping, Sequence

CHAT_ROLES = ("system", "user", "assistant")
"""Roles accepted in chat messages (``developer`` is accepted as an alias of ``system``)."""


class PromptTooLong(ValueError):
    """A text that cannot fit ``max_num_tokens``, found without tokenizing it: it has at least
    ``min_num_tokens`` tokens (:meth:`Tokenizer.min_num_tokens`)."""

    def __init__(self, min_num_tokens: int, max_num_tokens: int):
        super().__init__(f"the text has at least {min_num_tokens} tokens, more than {max_num_tokens}")
        self.min_num_tokens = min_num_tokens
        self.max_num_tokens = max_num_tokens


class MessageError(ValueError):
    """A chat message is malformed. ``param`` names the offending field, e.g.
    ``messages[1].content``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validate OpenAI chat ``messages`` and flatten them to ``[{"role", "content"}]``.

    Accepts roles ``system``/``developer``/``user``/``assistant``; ``content`` a string or
    a list of text parts ``{"type": "text", "text": str}`` (joined with no separator).
    Other fields (``name``...) are ignored. Source: OpenAI API reference, "Create chat
    completion", ``messages``.

    Raises :class:`MessageError` (a ``ValueError``) with ``param`` on any violation.
    """
    if not isinstance(messages, list):
        raise MessageError("'messages' must be a list of message objects", "messages")
    if not messages:
        raise MessageError("'messages' must contain at least one message", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise MessageError(f"{where} must be an object", where)
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in CHAT_ROLES:
            raise MessageError(
                f"{where}.role must be one of 'system', 'developer', 'user', 'assistant'; got {role!r}",
                f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    raise MessageError(f"{pw}: only parts of type 'text' are supported", pw)
                t = part.get("text")
                if not isinstance(t, str):
                    raise MessageError(f"{pw}.text must be a string", f"{pw}.text")
                parts.append(t)
            text = "".join(parts)
        else:
            raise MessageError(f"{where}.content must be a string or a list of text parts",
                               f"{where}.content")
        out.append({"role": role, "content": text})
    return out


def _dir_digest(path: str) -> str:
    """sha256 (hex) over the tokenizer files of ``path`` (names and bytes, sorted)."""
    h = hashlib.sha256()
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return ""
    for name in names:
        if not (name.startswith("tokenizer") or name.startswith("chat_template")
                or name.startswith("special_tokens") or name in ("vocab.json", "merges.txt")):
            continue
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            continue
        h.update(name.encode())
        h.update(b"\0")
        with open(full, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


class Tokenizer:
    """A loaded tokenizer with the cpd prompt conventions.

    Attributes: ``hf`` (the ``transformers`` tokenizer), ``vocab_size`` (``len(hf)``: valid
    ids are ``[0, vocab_size)``), ``eos_token_id`` (int or ``None``), ``special_ids``
    (frozenset of special-token ids, dropped from output text), ``digest`` (sha256 hex of the
    tokenizer files, for the block-hash namespace), ``path``.

    Safe to call from several threads at once (``tokenizers`` encodes through a shared,
    read-only object) as long as nobody changes the tokenizer's truncation/padding settings.
    """

    def __init__(self, hf: Any, path: str = ""):
        self.hf = hf
        self.path = path
        self.vocab_size = len(hf)
        self.eos_token_id = hf.eos_token_id
        self.special_ids = frozenset(int(i) for i in (hf.all_special_ids or ()))
        self.digest = _dir_digest(path) if path else ""
        self.segments = SegmentCache.build(hf)
        self.max_token_bytes = _max_token_bytes(hf)

    def min_num_tokens(self, text: str) -> int:
        """A lower bound of the tokens of ``text``, in time linear in its length and far below
        encoding it: with a byte-level BPE tokenizer every byte of the (normalized) text belongs
        to exactly one token, and no token stands for more than :attr:`max_token_bytes` bytes.
        0 (no bound) for other tokenizers."""
        if self.max_token_bytes is None:
            return 0
        normalizer = self.hf.backend_tokenizer.normalizer
        if normalizer is not None:  # e.g. NFC, which may shorten the text
            text = normalizer.normalize_str(text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    def check_fits(self, text: str, max_num_tokens: int | None) -> None:
        """Raise :class:`PromptTooLong` if ``text`` certainly has more than ``max_num_tokens``
        tokens (:meth:`min_num_tokens`). The router asks before tokenizing a prompt, so that a
        text far over the context costs its length in bytes, not an encoding of all of it."""
        if max_num_tokens is not None and self.max_token_bytes is not None \
                and len(text) > max_num_tokens:  # fewer characters than tokens allowed: fits
            n = self.min_num_tokens(text)
            if n > max_num_tokens:
                raise PromptTooLong(n, max_num_tokens)

    def encode_prompt(self, text: str, max_num_tokens: int | None = None) -> list[int]:
        """Token ids of a completions prompt string (special tokens added as the tokenizer
        is configured to, e.g. BOS). Raises :class:`PromptTooLong` without encoding a text
        that certainly has more than ``max_num_tokens`` tokens."""
        self.check_fits(text, max_num_tokens)
        return list(self.hf.encode(text, add_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The chat template applied to ``messages`` (validated by :func:`normalize_messages`)
        with ``add_generation_prompt=True``, as text. Raises :class:`MessageError` on bad
        messages and ``ValueError`` if the template rejects them or there is no template."""
        msgs = normalize_messages(messages)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template")
        try:
            text = self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja2 TemplateError raised by the template itself
            raise ValueError(f"chat template rejected the messages: {e}") from e
        if not isinstance(text, str):  # some versions return a list for batched input
            text = text[0]
        return text

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], cache_scope: Hashable = None,
                            max_num_tokens: int | None = None) -> list[int]:
        """Token ids of ``messages`` under the model's chat template with the generation
        prompt appended (see module docstring). Raises like :meth:`render_chat`, and
        :class:`PromptTooLong` without encoding a rendered text that certainly has more than
        ``max_num_tokens`` tokens.

        With a :class:`SegmentCache` (a fast tokenizer whose added tokens all split the text as
        they are, see there) the rendered text is encoded segment by segment, and long segments
        (a session's earlier messages) come from the cache of ``cache_scope`` (the tenant and
        cache salt: a scope never sees another's entries, not even as a faster answer); the ids
        are exactly those of encoding the whole text."""
        text = self.render_chat(messages)
        self.check_fits(text, max_num_tokens)
        if self.segments is not None:
            return self.segments.encode(text, cache_scope)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (reference decoding; streaming uses
        :class:`cpd.router.detokenize.IncrementalDetokenizer`)."""
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))


class SegmentCache:
    """Encode text (``add_special_tokens=False``) as the ``tokenizers`` library does, with the ids of
    long pieces cached.

    The library first splits the text at its added tokens (leftmost-longest match), maps each to
    its id and encodes every piece between them on its own (normalizer, pre-tokenizer, model);
    without special tokens to add, the ids are the concatenation. This class makes the same split
    and encodes the pieces in one ``encode_batch``; pieces of at least ``min_cached_chars`` are kept
    (LRU, at most ``max_cached_chars`` of text in all), so that a chat session's next turn, whose
    earlier messages are the same pieces (``role\\ncontent`` between ``<|im_start|>`` and
    ``<|im_end|>``), only encodes its new ones. Built only when that split is exact: every added token
    matched on the raw text as written (``normalized``, ``lstrip``, ``rstrip`` and ``single_word`` off,
    which a token marked special has by default), and checked against the whole-text encoding
    of a sample at start-up. Thread-safe."""

    def __init__(self, backend: Any, added: dict[str, int], min_cached_chars: int = 256,
                 max_cached_chars: int = 32 << 20):
        self.backend = backend
        self.added = added
        self.split_re = re.compile("|".join(re.escape(c) for c in sorted(added, key=len, reverse=True)))
        self.min_cached_chars = min_cached_chars
        self.max_cached_chars = max_cached_chars
        self._cache: OrderedDict[tuple[Hashable, str], tuple[int, ...]] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._encode_batch = getattr(backend, "encode_batch_fast", None) or backend.encode_batch

    @classmethod
    def build(cls, hf: Any) -> "SegmentCache | None":
        """The cache for ``hf`` (a ``transformers`` tokenizer), or None where the split would not be
        exact (a slow tokenizer, an added token matched after normalization or stripping spaces)."""
        backend = getattr(hf, "_tokenizer", None)
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return None
        added: dict[str, int] = {}
        for tid, t in backend.get_added_tokens_decoder().items():
            if t.normalized or t.lstrip or t.rstrip or t.single_word or not t.content:
                return None
            added[t.content] = int(tid)
        if not added:
            return None
        cache = cls(backend, added)
        sample = ("<|im_start|>system\nYou are  helpful.<|im_end|>\n<|im_start|>user\n  héllo wörld\t\n\n"
                  "x<|im_end|><|im_end|>12345 ' s 's\r\n😀" + "".join(added) + " tail")
        if cache.encode(sample, "self-check") != list(backend.encode(sample, add_special_tokens=False).ids):
            return None
        cache.clear()
        return cache

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_chars = 0
            self.hits = self.misses = 0

    def encode(self, text: str, scope: Hashable = None) -> list[int]:
        parts: list[Any] = []  # per piece: its ids (tuple), or the text to encode (str)
        pos = 0
        for m in self.split_re.finditer(text):
            if m.start() > pos:
                parts.append(text[pos:m.start()])
            parts.append((self.added[m.group()],))
            pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        todo: list[int] = []
        with self._lock:
            for i, p in enumerate(parts):
                if not isinstance(p, str):
                    continue
                ids = self._cache.get((scope, p)) if len(p) >= self.min_cached_chars else None
                if ids is None:
                    todo.append(i)
                else:
                    self._cache.move_to_end((scope, p))
                    parts[i] = ids
                    self.hits += 1
        if todo:
            encodings = self._encode_batch([parts[i] for i in todo], add_special_tokens=False)
            with self._lock:
                for i, enc in zip(todo, encodings):
                    piece, ids = parts[i], tuple(enc.ids)
                    parts[i] = ids
                    if len(piece) >= self.min_cached_chars:
                        self.misses += 1
                        self._remember((scope, piece), ids)
        out: list[int] = []
        for ids in parts:
            out.extend(ids)
        return out

    def _remember(self, key: tuple[Hashable, str], ids: tuple[int, ...]) -> None:
        if key in self._cache or len(key[1]) > self.max_cached_chars:
            return
        self._cache[key] = ids
        self._cached_chars += len(key[1])
        while self._cached_chars > self.max_cached_chars:
            (_, old), _ = self._cache.popitem(last=False)
            self._cached_chars -= len(old)


def _max_token_bytes(hf: Any) -> int | None:
    """Most bytes of text one token of ``hf`` stands for, where that bounds its token count
    (:meth:`Tokenizer.min_num_tokens`): a fast byte-level BPE tokenizer (``ByteLevel``
    pre-tokenizer and decoder), whose vocabulary strings have one character per byte; added
    tokens stand for their content. None for any other tokenizer (no bound)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel" \
            or "ByteLevel" not in repr(getattr(backend, "pre_tokenizer", None)):
        return None
    try:
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        longest = max((len(s) for s in backend.get_vocab(with_added_tokens=False)), default=0)
    except Exception:
        return None
    longest = max([longest, *(len(c.encode("utf-8")) for c in added)])
    return longest if longest > 0 else None


@functools.lru_cache(maxsize=8)
def load_tokenizer(tokenizer_dir: str) -> Tokenizer:
    """Load (once per process and directory) the tokenizer in ``tokenizer_dir`` with
    ``AutoTokenizer.from_pretrained``. Raises ``OSError``/``ValueError`` from transformers
    if the directory holds no tokenizer."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    return Tokenizer(hf, tokenizer_dir)


__all__ = ["Tokenizer", "SegmentCache", "PromptTooLong", "load_tokenizer", "normalize_messages", "MessageError", "CHAT_ROLES"]
