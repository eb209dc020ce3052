"""Stateless streaming detokenization (postprocess): deltas concatenate to the full decode, never with
a broken UTF-8 character, for text with multi-byte characters split across tokens."""

from __future__ import annotations

import functools

import pytest

from rngd_pd.engine.chunks import CONTEXT
from rngd_pd.stubs.text_models import load_tokenizer, text_delta

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


def _stream(tok, ids: list[int], per_response: int, stop: tuple[str, ...]) -> tuple[list[str], str]:
    """Chunks as decode would send them: it ends the stream where the text first holds a stop string."""
    from rngd_pd.engine.chunks import context_len

    end, reason = len(ids), "length"
    for k in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:k]) for s in stop):
            end, reason = k, "stop"
            break
    deltas = []
    for start in range(0, end, per_response):
        chunk = ids[start:min(end, start + per_response)]
        final = start + per_response >= end
        context = ids[max(0, start - context_len(stop)):start]
        deltas.append(text_delta(tok, context, chunk, final, stop=stop))
    return deltas, reason


@pytest.mark.parametrize(("text", "stop"), [
    ("Hello world, plain ASCII with  double spaces.", (", plain",)),
    ("Bonjour, ça va? Réponds: é, è, à, ô.", ("va?", "zzz")),
    ("日本語のテキストと絵文字 🎉🚀👍🏽 mixed with English.", ("🚀",)),
    ("  leading spaces\nand\ttabs\n\n", ("\n\n", "\t")),
])
@pytest.mark.parametrize("per_response", [1, 3])
def test_the_text_stops_before_the_first_stop_string(text: str, stop: tuple[str, ...],
                                                      per_response: int) -> None:
    tok = tokenizer()
    deltas, reason = _stream(tok, tok.encode(text), per_response, stop)
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    assert reason == "stop" and "".join(deltas) == text[:cut]
    assert not any(s in "".join(deltas) for s in stop)


@pytest.mark.parametrize("per_response", [1, 2])
def test_a_held_back_partial_stop_string_is_released_when_it_does_not_complete(per_response: int) -> None:
    tok = tokenizer()
    text = "one two three four"
    deltas, reason = _stream(tok, tok.encode(text), per_response, ("two three five", "four!"))
    assert reason == "length" and "".join(deltas) == text
    if per_response == 1:  # once "one two three" is out, "two three" may still begin "two three five"
        ids = tok.encode(text)
        k = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]) == "one two three")
        assert "".join(deltas[:k]) == "one "
