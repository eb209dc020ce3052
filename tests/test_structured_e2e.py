"""e2e: structured outputs and tool calls through the OpenAI front end, a real tritonserver (pd: prefill
samples the first token under the grammar, decode the rest; colocated too) and the official openai SDK,
on the embedded 135M model. jsonschema, `re` and the SDK's own types are the oracles."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, Field

from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.model.structured import Structured
from rngd_pd.testing import e2e as E
from tests import test_frontend_e2e as fe
from tests.frontend_fakes import serve_app

MODEL, client = fe.MODEL, fe.client
triton, served, url = fe.triton, fe.served, fe.url  # the same module fixtures: one tritonserver here

pytestmark = pytest.mark.e2e

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "author": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20},
                               "born": {"type": "integer", "minimum": 1000, "maximum": 2025}},
                "required": ["name", "born"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "author"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confident": {"type": "boolean"}},
        "required": ["sentiment", "confident"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                  "minItems": 1, "maxItems": 3}},
        "required": ["colors"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}]


def _fields_known(raw: Any, model: type[BaseModel]) -> None:
    """Every key of `raw` is a field of the SDK's type (no extra fields), recursively."""
    assert isinstance(raw, dict)
    unknown = set(raw) - set(model.model_fields)
    assert not unknown, f"{model.__name__} has no fields {unknown}"
    for name, value in raw.items():
        ann = model.model_fields[name].annotation
        inner = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)]
        for sub in inner:
            for a in [sub, *getattr(sub, "__args__", ())]:
                if isinstance(a, type) and issubclass(a, BaseModel):
                    for v in value if isinstance(value, list) else [value]:
                        if isinstance(v, dict):
                            _fields_known(v, a)


def _chat(url: str, stream: bool, **kwargs: Any) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish reason) of one chat request, streamed or not, through the SDK; the
    raw JSON is checked against the SDK's types (no unknown fields) on the way."""
    c = client(url)
    if not stream:
        raw = c.chat.completions.with_raw_response.create(model=MODEL, **kwargs)
        body = json.loads(raw.text)
        _fields_known(body, ChatCompletion)
        msg = raw.parse().choices[0]
        calls = [tc.model_dump() for tc in msg.message.tool_calls or []]
        return msg.message.content or "", calls, msg.finish_reason
    content, calls, reason = [], {}, None
    for chunk in c.chat.completions.create(model=MODEL, stream=True, **kwargs):
        _fields_known(chunk.model_dump(exclude_unset=True), ChatCompletionChunk)
        for ch in chunk.choices:
            content.append(ch.delta.content or "")
            for tc in ch.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                call["id"] = tc.id or call["id"]
                call["function"]["name"] += (tc.function.name or "") if tc.function else ""
                call["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
            reason = ch.finish_reason or reason
    return "".join(content), [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_replies_validate(url, name, sampling, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    ask = [{"role": "user", "content": f"Give me a {name} example."}]
    text, calls, reason = _chat(url, stream, messages=ask, response_format=fmt, max_tokens=120, **sampling)
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    assert reason == "stop" and not calls


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    verdict: Literal["buy", "skip"]
    summary: str = Field(max_length=30)


def test_sdk_parse_and_json_object(url):
    r = client(url).chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Review a phone."}], response_format=Review,
        max_tokens=100, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Review)
    for extra in ({"response_format": {"type": "json_object"}},
                  {"extra_body": {"structured_outputs": {"json_object": True}}}):
        ask = [{"role": "user", "content": 'Describe Bob, 30, as JSON like {"name": "Ann", "age": 5}.'}]
        text, _, _ = _chat(url, False, messages=ask, max_tokens=100, temperature=0, **extra)
        assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("stream", [False, True])
def test_regex_and_choice_match(url, stream):
    q = [{"role": "user", "content": "Is water wet?"}]
    text, _, reason = _chat(url, stream, messages=q, max_tokens=20, temperature=1.0, seed=1,
                            extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert text in ("yes", "no", "it depends") and reason == "stop"
    text, _, _ = _chat(url, stream, messages=q, max_tokens=20, temperature=0,
                       extra_body={"structured_outputs": {"choice": ["wet", "dry"]}})
    assert text in ("wet", "dry")
    pattern = r"\d{3}-[A-Z]{2}"
    text, _, _ = _chat(url, stream, messages=q, max_tokens=20, temperature=0,
                       extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, text), text
    r = client(url).completions.create(model=MODEL, prompt="The answer is", max_tokens=10, temperature=0,
                                       extra_body={"guided_regex": r" (yes|no)\."})
    assert re.fullmatch(r" (yes|no)\.", r.choices[0].text), r.choices[0].text
    text, _, _ = _chat(url, stream, messages=q, max_tokens=20, temperature=0,
                       extra_body={"guided_grammar": 'root ::= "answer: " ("yes" | "no")'})
    assert text in ("answer: yes", "answer: no")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "sampled"])
def test_named_tool_choice_always_yields_a_valid_call(url, sampling, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, reason = _chat(url, stream, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
                                   max_tokens=80, **sampling)
    assert not content and reason == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_and_parallel_calls(url, stream):
    _, calls, reason = _chat(url, stream, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                             parallel_tool_calls=False, max_tokens=100, temperature=0)
    assert reason == "tool_calls" and len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_tool_results_go_back_into_the_template(url):
    first = client(url).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    for choice in ("auto", "none"):
        r = client(url).chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                                tool_choice=choice, max_tokens=30, temperature=0)
        m = r.choices[0]
        assert m.finish_reason in ("stop", "length", "tool_calls")
        assert m.message.content or m.message.tool_calls
        if choice == "none":
            assert not m.message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "response_format", "schema is invalid at type"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "format": "shoe"}, "strict": True}}},
         "response_format", "Unknown format"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "unclosed group"),
        ({"extra_body": {"guided_grammar": "start: nothing_here"}}, "guided_grammar", "unknown name"),
        ({"extra_body": {"guided_json": {"properties": {"a": {"$ref": "#/$defs/gone"}}}}}, "guided_json",
         "does not exist"),
        ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice", "at most one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "not in 'tools'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
         "tools", "JSON schema is invalid"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ],
)
def test_invalid_constraints_are_400_with_the_reason(url, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client(url).chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **extra)
    err = info.value.body
    assert err["param"] == param and words in err["message"], err


@pytest.fixture(scope="module")
def colocated_url(triton, served) -> Iterator[str]:
    with serve_app(create_app(FrontendConfig(triton_url=triton.grpc_url, triton_model="colocated"),
                              model=served)) as base:
        yield base


def test_colocated_and_raw_http(colocated_url):
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enum"]}}
    text, _, _ = _chat(colocated_url, True, messages=ASK, response_format=fmt, max_tokens=60, temperature=0)
    jsonschema.validate(json.loads(text), SCHEMAS["enum"])
    body = {"model": MODEL, "messages": ASK, "max_tokens": 40, "temperature": 0, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = httpx.post(colocated_url + "/v1/chat/completions", json=body, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert r["choices"][0]["message"]["tool_calls"][0]["type"] == "function"


def test_tritonclient_sends_the_structured_input(triton, served):
    """Triton's own interface: `structured` (rngd_pd.model.structured's JSON) on pd, no front end."""
    spec = Structured("regex", r"[0-9]{4}-[0-9]{2}")
    tok = served.tokenizer
    values = E.pd_inputs(tok.encode("Write a date."), max_tokens=20,
                         structured=np.array([spec.to_json().encode()], dtype=np.object_))
    responses = E.stream_infer(triton.grpc_url, "pd", values, ("output_ids", "finish_reason"))
    assert re.fullmatch(spec.value, tok.decode(E.ids_of(responses))) and E.reason_of(responses) == "stop"


def _choices(url: str, stream: bool, **kwargs: Any) -> dict[int, dict]:
    """Each choice of one chat request (n > 1): content, tool calls, logprob rows, finish reason; the
    raw JSON checked against the SDK's types."""
    c = client(url)
    out: dict[int, dict] = {}
    if not stream:
        raw = c.chat.completions.with_raw_response.create(model=MODEL, **kwargs)
        _fields_known(json.loads(raw.text), ChatCompletion)
        for ch in raw.parse().choices:
            out[ch.index] = {"content": ch.message.content or "", "reason": ch.finish_reason,
                             "calls": [tc.model_dump() for tc in ch.message.tool_calls or []],
                             "rows": ch.logprobs.content if ch.logprobs else []}
        return out
    for chunk in c.chat.completions.create(model=MODEL, stream=True, **kwargs):
        _fields_known(chunk.model_dump(exclude_unset=True), ChatCompletionChunk)
        for ch in chunk.choices:
            mine = out.setdefault(ch.index, {"content": "", "reason": None, "calls": {}, "rows": []})
            mine["content"] += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                call = mine["calls"].setdefault(tc.index, {"id": None,
                                                           "function": {"name": "", "arguments": ""}})
                call["id"] = tc.id or call["id"]
                call["function"]["name"] += (tc.function.name or "") if tc.function else ""
                call["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
            mine["rows"] += ch.logprobs.content if ch.logprobs and ch.logprobs.content else []
            mine["reason"] = ch.finish_reason or mine["reason"]
    for mine in out.values():
        mine["calls"] = [mine["calls"][i] for i in sorted(mine["calls"])]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_each_follow_the_schema_with_logprobs(url, stream):
    """n=3 sampled under one json_schema: every choice is its own grammar state (prefill samples each
    first token under it, decode goes on per choice), and carries the raw logprobs of its tokens."""
    fmt = {"type": "json_schema",
           "json_schema": {"name": "array", "schema": SCHEMAS["array"], "strict": True}}
    ask = [{"role": "user", "content": "Give me an array example."}]
    got = _choices(url, stream, messages=ask, response_format=fmt, max_tokens=80, n=3, temperature=1.0,
                   seed=5, logprobs=True, top_logprobs=2, presence_penalty=0.5)
    assert sorted(got) == [0, 1, 2]
    for mine in got.values():
        assert mine["reason"] == "stop", mine
        jsonschema.validate(json.loads(mine["content"]), SCHEMAS["array"])
        assert mine["rows"] and mine["content"].startswith(mine["rows"][0].token.strip())
        assert all(r.logprob <= 0 and len(r.top_logprobs) == 2 for r in mine["rows"])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_with_n_gives_each_choice_a_valid_call(url, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    got = _choices(url, stream, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=80,
                   n=2, temperature=1.0, seed=3)
    assert sorted(got) == [0, 1]
    ids = set()
    for mine in got.values():
        assert not mine["content"] and mine["reason"] == "tool_calls" and len(mine["calls"]) == 1, mine
        call = mine["calls"][0]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        ids.add(call["id"])
    assert len(ids) == 2


def test_n_greedy_under_a_grammar_on_colocated(colocated_url):
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enum"]}}
    got = _choices(colocated_url, True, messages=ASK, response_format=fmt, max_tokens=60, temperature=0, n=2,
                   logprobs=True)
    assert got[0]["content"] == got[1]["content"]  # greedy: identical choices
    jsonschema.validate(json.loads(got[0]["content"]), SCHEMAS["enum"])
