"""Stateless streaming detokenization (postprocess): deltas concatenate to the full decode, never with
a broken UTF-8 character, for text with multi-byte characters split across tokens."""

from __future__ import annotations

import functools

import pytest

from rngd_pd.triton.orchestrator import CONTEXT
from rngd_pd.triton.text_models import load_tokenizer, text_delta

TEXTS = (
    "Hello world, plain ASCII with  double spaces.",
    "Bonjour, ça va? Réponds: é, è, à, ô.",
    "日本語のテキストと絵文字 🎉🚀👍🏽 mixed with English.",
    "  leading spaces\nand\ttabs\n\n",
)


@functools.cache
def tokenizer():
    return load_tokenizer(None)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("per_response", [1, 3])
def test_deltas_concatenate_to_the_full_decode(text: str, per_response: int) -> None:
    tok = tokenizer()
    ids = tok.encode(text)
    deltas = []
    for start in range(0, len(ids), per_response):
        chunk = ids[start:start + per_response]
        final = start + per_response >= len(ids)
        delta = text_delta(tok, ids[max(0, start - CONTEXT):start], chunk, final)
        assert "\ufffd" not in delta
        deltas.append(delta)
    assert "".join(deltas) == tok.decode(ids) == text


def test_an_incomplete_character_is_held_back_until_it_completes() -> None:
    tok = tokenizer()
    ids = tok.encode("🎉")
    assert len(ids) > 1  # the emoji spans byte tokens
    assert text_delta(tok, [], ids[:1], final=False) == ""
    assert text_delta(tok, ids[:1], ids[1:], final=True) == "🎉"
