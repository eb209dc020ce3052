"""The OpenAI and vLLM spellings of a structured output -> one checked `Structured`.

Accepted, as vLLM accepts them: `response_format` (`json_object`, `json_schema` with `strict`), the
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and the newer
`structured_outputs` object. At most one may be given; each is compiled here (a bad schema, regex or
grammar is a 400 that names the parameter and the problem) before anything reaches Triton.
"""

from __future__ import annotations

import json
from typing import Any

from rngd_pd.errors import ConfigError
from rngd_pd.frontend.api_errors import bad_request
from rngd_pd.frontend.schemas import JsonObjectFormat, JsonSchemaFormat, _GenerationRequest
from rngd_pd.model.structured import Structured


def structured_of(body: _GenerationRequest) -> tuple[Structured, str] | None:
    """The request's constraint and the parameter that gave it (None: unconstrained); 400 when
    several are given or the one given cannot be enforced."""
    found = [(param, spec) for param, spec in _candidates(body) if spec is not None]
    if len(found) > 1:
        raise bad_request(
            f"give at most one structured output; got {', '.join(p for p, _ in found)}",
            found[1][0], "invalid_value",
        )
    if not found:
        return None
    param, spec = found[0]
    return checked(spec, param), param


def checked(spec: Structured, param: str) -> Structured:
    """`spec` once compiled; 400 naming `param` and the problem otherwise."""
    try:
        return spec.check()
    except ConfigError as e:
        raise bad_request(f"'{param}': {e}", param, "invalid_value") from None


def _candidates(body: _GenerationRequest) -> list[tuple[str, Structured | None]]:
    fmt = body.response_format
    out: list[tuple[str, Structured | None]] = [("response_format", _from_format(fmt))]
    if body.guided_json is not None:
        out.append(("guided_json", _json_schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        out.append(("guided_regex", Structured("regex", body.guided_regex)))
    if body.guided_choice is not None:
        out.append(("guided_choice", Structured("choice", body.guided_choice)))
    if body.guided_grammar is not None:
        out.append(("guided_grammar", Structured("grammar", body.guided_grammar)))
    so = body.structured_outputs
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if v is not None}
        if len(given) != 1:
            raise bad_request("'structured_outputs' needs exactly one of json, regex, choice, grammar, "
                              f"json_object; got {', '.join(given) or 'none'}", "structured_outputs",
                              "invalid_value")
        (kind, value), = given.items()
        out.append(("structured_outputs", _json_schema(value, "structured_outputs") if kind == "json"
                    else Structured("json_object") if kind == "json_object" else Structured(kind, value)))
    return out


def _from_format(fmt: Any) -> Structured | None:
    if isinstance(fmt, JsonObjectFormat):
        return Structured("json_object")
    if isinstance(fmt, JsonSchemaFormat):
        spec = fmt.json_schema
        if spec.schema_ is None:
            raise bad_request("'response_format.json_schema.schema' is required", "response_format",
                              "invalid_value")
        return Structured("json_schema", spec.schema_, strict=bool(spec.strict))
    return None


def _json_schema(value: Any, param: str) -> Structured:
    """A schema given as an object or as JSON text (vLLM takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"'{param}' is not a JSON schema: {e}", param, "invalid_value") from None
    return Structured("json_schema", value)
