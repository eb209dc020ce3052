"""Structured outputs: what a request constrains its reply to, checked once and carried as JSON text.

A `Structured` is the one description of a constraint every hop shares: the front end builds it from
the OpenAI body (`response_format`, vLLM's `guided_*` and `structured_outputs`, a forced tool call),
checks it here (a bad schema, regex or grammar is a ConfigError naming the problem, so the client gets
a 400 before anything reaches Triton), and sends `to_json()` in the `structured` input; the stubs read
it back with `from_json` and `rngd_pd.model.grammar` turns `grammar()` into a token mask per step.

The grammar engine is llguidance (Rust, no torch): it compiles JSON schemas, regexes and Lark/GBNF
grammars into one grammar format. Torch-free, so the front end imports it.

JSON replies are compact (no free whitespace between tokens): a small model given free whitespace can
fill max_tokens with newlines and never close the object (seen with vLLM and the 135M model too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, get_args

import jsonschema
import llguidance

from rngd_pd.errors import ConfigError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = get_args(Kind)
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}  # compact JSON (module docstring)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Structured:
    """One request's constraint. `value` by kind: json_schema a JSON Schema (dict or bool), json_object
    None, regex a pattern, choice a list of strings, grammar a Lark or GBNF (llama.cpp) grammar.
    `strict`: unsupported JSON Schema keywords are an error (OpenAI's `strict: true`); otherwise
    they are ignored, as vLLM does."""

    kind: Kind
    value: Any = None
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"structured output type must be one of {', '.join(KINDS)}, got {self.kind!r}")

    def to_json(self) -> str:
        """The wire form: `{"type": kind, "value": ..., "strict": bool}` (the `structured` input)."""
        return json.dumps({"type": self.kind, "value": self.value, "strict": self.strict},
                          separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Structured:
        """Parse the wire form; ConfigError naming what is wrong."""
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"structured: not JSON ({e})") from None
        if not isinstance(doc, dict) or set(doc) - {"type", "value", "strict"} or "type" not in doc:
            raise ConfigError('structured must be {"type": ..., "value": ..., "strict": ...}')
        return cls(doc["type"], doc.get("value"), bool(doc.get("strict", False)))

    def grammar(self) -> str:
        """The llguidance grammar; checked (ConfigError naming the problem). Cached per text."""
        return compile_grammar(self.to_json())

    def check(self) -> Structured:
        """Raise ConfigError if this cannot be enforced; returns self (for chaining at the edge)."""
        self.grammar()
        return self


@lru_cache(maxsize=256)
def compile_grammar(wire: str) -> str:
    """Wire JSON -> checked llguidance grammar text; cached, so a repeated schema costs one compile."""
    spec = Structured.from_json(wire)
    grammar = _grammar(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ConfigError(f"{_what(spec)} cannot be enforced: {messages[0] if messages else 'invalid'}")
    return grammar


def _what(spec: Structured) -> str:
    return {"json_schema": "the JSON schema", "json_object": "json_object", "regex": "the regex",
            "choice": "the choice list", "grammar": "the grammar"}[spec.kind]


def _grammar(spec: Structured) -> str:
    if spec.kind in ("json_schema", "json_object"):
        schema = _ANY_OBJECT if spec.kind == "json_object" else spec.value
        _check_schema(schema)
        options = {**_JSON_OPTIONS, "lenient": not spec.strict}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        except ValueError as e:
            raise ConfigError(f"the JSON schema cannot be enforced: {e}") from None
    if spec.kind == "regex":
        if not isinstance(spec.value, str) or not spec.value:
            raise ConfigError(f"the regex must be a non-empty string, got {spec.value!r}")
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        choices = spec.value
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ConfigError(f"the choice list must hold non-empty strings (at least one), got {choices!r}")
        return llguidance.grammar_from("choice", choices)  # type: ignore[arg-type]
    if not isinstance(spec.value, str) or not spec.value.strip():
        raise ConfigError(f"the grammar must be a non-empty string, got {spec.value!r}")
    try:
        return llguidance.grammar_from("grammar", spec.value)
    except ValueError as e:
        raise ConfigError(f"the grammar cannot be enforced: {e}") from None


def _check_schema(schema: Any) -> None:
    """A JSON Schema must be an object (or a boolean) that its own metaschema accepts."""
    if not isinstance(schema, dict | bool):
        raise ConfigError(f"the JSON schema must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ConfigError(f"the JSON schema is invalid at {where}: {e.message}") from None
