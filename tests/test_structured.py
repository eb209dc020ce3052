"""Structured outputs without a server: the wire form, the checks at the edge, and the token mask
driven against the embedded model's real tokenizer (random logits stand in for the model: whatever it
prefers, every reply must parse and validate; jsonschema and `re` are the oracles)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from rngd_pd.errors import ConfigError
from rngd_pd.model.checkpoint import load_tokenizer
from rngd_pd.model.grammar import grammars_for
from rngd_pd.model.sampling import Sampler, SamplingParams
from rngd_pd.model.structured import Structured

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1,
                     "maxItems": 3},
            "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()[1]


def _run(tokenizer, structured: Structured, seed: int, max_tokens: int = 200) -> str:
    """Drive a constraint with random logits (temperature 1) until its grammar ends."""
    grammars = grammars_for(tokenizer)
    c = grammars.constraint(structured.to_json())
    assert c is not None
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens))
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        tok = sampler.sample(torch.randn(grammars.vocab, generator=gen) * 4, c)
        c.accept(tok)
        if tok in tokenizer.eos_token_ids:
            break
        ids.append(tok)
        if c.is_terminated():
            break
    else:
        pytest.fail(f"the grammar did not end in {max_tokens} tokens: {tokenizer.decode(ids)!r}")
    return tokenizer.decode(ids)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_replies_validate(tokenizer, name: str, seed: int) -> None:
    text = _run(tokenizer, Structured("json_schema", SCHEMAS[name], strict=True), seed)
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_starts_an_object(tokenizer) -> None:
    # any object: random logits could write keys for ever, so check the first step only (e2e tests
    # run it to the end with the model)
    c = grammars_for(tokenizer).constraint(Structured("json_object").to_json())
    assert c is not None
    allowed = torch.nonzero(c.allowed()).flatten().tolist()
    assert allowed and all(tokenizer.decode([i]).startswith("{") for i in allowed)


def test_regex_and_choice_match(tokenizer) -> None:
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    for seed in range(3):
        assert re.fullmatch(pattern, _run(tokenizer, Structured("regex", pattern), seed))
        assert _run(tokenizer, Structured("choice", ["yes", "no", "maybe later"]), seed) in {
            "yes", "no", "maybe later"}


def test_gbnf_grammar(tokenizer) -> None:
    text = _run(tokenizer, Structured("grammar", 'root ::= "x=" [0-9] [0-9]?'), 0)
    assert re.fullmatch(r"x=\d\d?", text)


def test_mask_forbids_what_the_grammar_forbids(tokenizer) -> None:
    c = grammars_for(tokenizer).constraint(Structured("choice", ["yes", "no"]).to_json())
    assert c is not None
    logits = torch.zeros(c.vocab)
    masked = c.mask_into(logits)
    allowed = {i for i in range(c.vocab) if masked[i] != float("-inf")}
    texts = {tokenizer.decode([i]) for i in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert all(c.allows(i) == (i in allowed) for i in range(c.vocab))
    with pytest.raises(Exception, match="breaks the request's grammar"):
        c.accept(tokenizer.encode("maybe")[0])


def test_wire_round_trip() -> None:
    s = Structured("json_schema", SCHEMAS["enum"], strict=True)
    assert Structured.from_json(s.to_json()) == s
    with pytest.raises(ConfigError, match="type must be one of"):
        Structured.from_json('{"type": "xml", "value": 1}')
    with pytest.raises(ConfigError, match="not JSON"):
        Structured.from_json("{")


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (Structured("json_schema", {"type": "objekt"}), "invalid at type"),
        (Structured("json_schema", {"type": "object", "required": "a"}), "invalid at required"),
        (Structured("json_schema", [1, 2]), "must be a JSON object"),
        (Structured("json_schema", {"properties": {"a": {"$ref": "#/$defs/missing"}}}), "does not exist"),
        (Structured("json_schema", {"type": "string", "format": "shoe-size"}, strict=True), "Unknown format"),
        (Structured("regex", "(ab"), "unclosed group"),
        (Structured("choice", []), "at least one"),
        (Structured("grammar", "start: undefined_rule"), "unknown name"),
    ],
)
def test_bad_constraints_name_the_problem(spec: Structured, reason: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(reason)):
        spec.check()
