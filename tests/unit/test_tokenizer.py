"""Incremental detokenization concatenates to the whole-sequence decode, never broken UTF-8."""

from __future__ import annotations

import pytest

from tokenizer_svc.tokenizer import ChatTemplateError, IncrementalDetokenizer, TextTokenizer

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "naïve café — 東京は日本の首都です 🙂🚀 done",
    "  leading spaces and\ttabs\nnew lines  ",
]


@pytest.fixture(scope="module")
def tok(default_model):
    return TextTokenizer(default_model)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_chat_template_renders_in_a_sandbox(tok):
    ids = tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system")
    tok.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        tok.render_chat([{"role": "user", "content": "x"}])
