"""n, logprobs and batched prompts together with structured outputs and tool calls in the front end,
over the scripted backend (tests/frontend_fakes.py; its n choices interleave token by token): each
choice is parsed into its own tool calls, streamed tool-call deltas carry their choice's index, and
every request the backend gets holds both the grammar and the sampling extensions. The openai SDK's
types parse every reply. The engines' side (one grammar state per choice) is in
tests/test_engine_structured.py; the real server in tests/test_structured_e2e.py and
tests/test_api_features_e2e.py."""

from __future__ import annotations

import json

import openai
import pytest

from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.served_model import load_served_model
from rngd_pd.model.structured import Structured
from tests.frontend_fakes import ALL_INPUTS, FakeBackend, serve_app

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
ARGS = '{"city": "Oslo"}'
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def served():
    return load_served_model(FrontendConfig())


def _serve(served, script: str):
    """A front end over a backend that answers `script`, then EOS (every choice alike)."""
    backend = FakeBackend(served.tokenizer, script=script, inputs=ALL_INPUTS)
    backend.eos_at = len(backend.ids)
    return backend, serve_app(create_app(FrontendConfig(), model=served, backend=backend))


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_named_tool_choice_streams_each_choice_with_its_index_and_logprobs(served) -> None:
    backend, server = _serve(served, ARGS)
    with server as url:
        chunks = list(_client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], n=2, logprobs=True, top_logprobs=2,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True,
            stream_options={"include_usage": True}))
    req = backend.requests[0]
    assert req.params.n == 2 and req.params.logprobs == 2
    assert Structured.from_json(req.params.structured).value == WEATHER["function"]["parameters"]
    by_index: dict[int, list] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            by_index[choice.index].append(choice)
    tokens = len(backend.ids) + 1  # the arguments, then EOS
    for index, choices in by_index.items():
        calls = [c.delta.tool_calls[0] for c in choices if c.delta.tool_calls]
        assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather", index
        assert all(c.index == 0 for c in calls)  # the call's index counts within the choice
        assert "".join(c.function.arguments for c in calls) == ARGS
        assert [c.finish_reason for c in choices if c.finish_reason] == ["tool_calls"]
        rows = [e for c in choices if c.logprobs for e in c.logprobs.content]
        assert len(rows) == tokens and all(len(e.top_logprobs) == 2 for e in rows)
    ids = {c.delta.tool_calls[0].id for cs in by_index.values() for c in cs if c.delta.tool_calls
           and c.delta.tool_calls[0].id}
    assert len(ids) == 2  # one call per choice, each its own id
    assert chunks[-1].usage.completion_tokens == 2 * tokens


def test_auto_tool_calls_parse_per_choice(served) -> None:
    reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    backend, server = _serve(served, reply)
    with server as url:
        r = _client(url).chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], n=3,
                                                 temperature=0.7, seed=1, logprobs=True)
        stream = list(_client(url).chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                                           n=2, stream=True))
    assert backend.requests[0].params.structured is None  # auto is not constrained
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
        assert len(choice.logprobs.content) == len(backend.ids) + 1
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3
    for index in (0, 1):
        mine = [c for chunk in stream for c in chunk.choices if c.index == index]
        [delta] = [c.delta for c in mine if c.delta.tool_calls]
        assert json.loads(delta.tool_calls[0].function.arguments) == {"city": "Oslo"}
        assert [c.finish_reason for c in mine if c.finish_reason] == ["tool_calls"]


def test_json_schema_with_n_logprobs_and_penalties_and_batched_prompts(served) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    backend, server = _serve(served, '{"a": 1}')
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with server as url:
        chat = _client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=fmt, n=2, logprobs=True, top_logprobs=1,
            presence_penalty=0.5, logit_bias={"7": 3.0}, extra_body={"min_tokens": 1, "stop_token_ids": [9]})
        done = _client(url).completions.create(model=MODEL, prompt=["one", "two"], n=2, logprobs=1,
                                               max_tokens=20, extra_body={"guided_json": schema})
    for req in backend.requests:
        assert Structured.from_json(req.params.structured).value == schema
    p = backend.requests[0].params
    assert (p.n, p.logprobs, p.presence_penalty, p.logit_bias, p.min_tokens, p.stop_token_ids) == (
        2, 1, 0.5, ((7, 3.0),), 1, (9,))
    assert [json.loads(c.message.content) for c in chat.choices] == [{"a": 1}, {"a": 1}]
    assert all(len(c.logprobs.content) == len(backend.ids) + 1 for c in chat.choices)
    assert len(backend.requests) == 3  # the chat, then one request per prompt
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert all(json.loads(c.text) == {"a": 1} and c.logprobs.tokens for c in done.choices)
    assert done.usage.completion_tokens == 4 * (len(backend.ids) + 1)


def test_a_grammar_with_an_enforced_tool_is_refused_whatever_n(served) -> None:
    backend, server = _serve(served, ARGS)
    with server as url, pytest.raises(openai.BadRequestError) as info:
        _client(url).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required", n=2,
            response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format" and not backend.requests
