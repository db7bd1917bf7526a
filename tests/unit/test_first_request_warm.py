"""The router's first request does no one-time tokenizer work (issue 11/10, "first-request router
delay").

A live router spent 0.11-0.84 s (modeled; 0.3-1.4 s wall at K = 3) on its first request before
reaching a worker, against 0.003-0.006 s for later ones: the incremental detokenizer checked
whether the tokenizer is byte-level BPE by serialising the whole tokenizer to JSON (1.5 MB for
SmolLM2) and parsing it back, once per process, inside the first request
(docs/results/modeled_ordering/README.md, "Session 12"). Now the check reads the decoder object,
and the router does it when it builds its app.
"""
from __future__ import annotations

from cpd.router.detokenize import IncrementalDetokenizer, _is_byte_level
from cpd.router.openai_front import create_app
from cpd.router.tokenization import Tokenizer, load_tokenizer


class _NoBackend:
    async def generate(self, req):  # never called here
        raise AssertionError("no request is sent")
        yield


def _fresh_tokenizer(model_dir: str) -> Tokenizer:
    hf = load_tokenizer(model_dir).hf
    return Tokenizer(hf, model_dir)  # a new wrapper: no byte table cached on it yet


def test_the_byte_level_check_reads_the_decoder_not_the_serialised_tokenizer(tiny_model_dir):
    tok = _fresh_tokenizer(tiny_model_dir)
    backend = tok.hf.backend_tokenizer

    class _Spy:  # the real backend, except that serialising it is refused
        decoder = backend.decoder

        def to_str(self):
            raise AssertionError("the whole tokenizer was serialised to read its decoder type")

    class _Hf:
        backend_tokenizer = _Spy()

    assert _is_byte_level(_Hf()) is True  # SmolLM2: byte-level BPE

    class _NoDecoderAttr:  # an older backend: the JSON route still answers
        def to_str(self):
            return '{"decoder": {"type": "ByteLevel"}}'

    class _Hf2:
        backend_tokenizer = _NoDecoderAttr()

    assert _is_byte_level(_Hf2()) is True


def test_the_router_prepares_the_detokenizer_when_it_builds_its_app(tiny_model_dir):
    tok = _fresh_tokenizer(tiny_model_dir)
    assert getattr(tok, "_cpd_byte_table", False) is False  # nothing done yet
    create_app(_NoBackend(), tiny_model_dir, "m", 2048, tokenizer=tok)
    table = getattr(tok, "_cpd_byte_table", False)
    assert table is not False and table is not None  # built at start-up, byte-level
    d = IncrementalDetokenizer(tok)  # a request's detokenizer reuses it
    ids = tok.encode_prompt("héllo wörld — ok")
    assert d.push(ids) + d.flush() == tok.decode(ids)
