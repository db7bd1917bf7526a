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
from typing import Any, Iterable, Mapping, Sequence

CHAT_ROLES = ("system", "user", "assistant")
"""Roles accepted in chat messages (``developer`` is accepted as an alias of ``system``)."""


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

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completions prompt string (special tokens added as the tokenizer
        is configured to, e.g. BOS)."""
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

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of ``messages`` under the model's chat template with the generation
        prompt appended (see module docstring). Raises like :meth:`render_chat`."""
        text = self.render_chat(messages)
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` (reference decoding; streaming uses
        :class:`cpd.router.detokenize.IncrementalDetokenizer`)."""
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))


@functools.lru_cache(maxsize=8)
def load_tokenizer(tokenizer_dir: str) -> Tokenizer:
    """Load (once per process and directory) the tokenizer in ``tokenizer_dir`` with
    ``AutoTokenizer.from_pretrained``. Raises ``OSError``/``ValueError`` from transformers
    if the directory holds no tokenizer."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    return Tokenizer(hf, tokenizer_dir)


__all__ = ["Tokenizer", "load_tokenizer", "normalize_messages", "MessageError", "CHAT_ROLES"]
