"""Tool calls in the front end without a server: the plan a request makes, the prompt the templates
get (the embedded SmolLM2 template, which has no tools, and a Llama-3.1-style template that has), the
reply parsed into calls and the stream into deltas; the OpenAI SDK's types parse what comes out."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage

from rngd_pd.frontend.api_errors import APIError
from rngd_pd.frontend.schemas import ChatCompletionRequest
from rngd_pd.frontend.tools import ToolStream, parse_calls, plan_tools, render_messages, reply_message
from rngd_pd.model.checkpoint import load_tokenizer
from rngd_pd.model.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
# the tool part of Llama 3.1's template, in its shape: tools in the first user turn, calls as JSON
LLAMA_LIKE = (
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if tools and loop.first %}{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}<|assistant|>"
)


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "weather in Oslo?"}], **kw})


def _plan(**kw):
    return plan_tools(_body(**kw))


def test_plans() -> None:
    assert _plan().mode == "none" and not _plan().parses
    assert _plan(tools=[WEATHER]).mode == "auto"
    forced = {"type": "function", "function": {"name": "get_weather"}}
    named = _plan(tools=[WEATHER, CLOCK], tool_choice=forced)
    assert named.mode == "named" and named.structured.value == WEATHER["function"]["parameters"]
    required = _plan(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert required.structured.value["maxItems"] == 1
    assert {o["properties"]["name"]["const"] for o in required.structured.value["items"]["anyOf"]} == {
        "get_weather", "get_time"}
    for kw, param in (({"tool_choice": "auto"}, "tool_choice"),
                      ({"tools": [WEATHER, WEATHER]}, "tools"),
                      ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                       "tool_choice")):
        with pytest.raises(APIError) as info:
            _plan(**kw)
        assert info.value.param == param and info.value.status == 400


def _history():
    return _body(tools=[WEATHER], messages=[
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}])


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    body = _history()
    tok = load_tokenizer()[1]
    assert not tok.renders_tools
    messages, tools = render_messages(body.messages, plan_tools(body), tok.renders_tools)
    text = tok.apply_chat_template(messages, tools=tools)
    assert tools is None and text.startswith("<|im_start|>system\nYou can call functions.")
    assert json.dumps(WEATHER["function"]) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<|im_start|>tool\n12 C, rain<|im_end|>" in text


def test_a_template_with_tools_gets_them_as_hugging_face_passes_them() -> None:
    body = _history()
    tok = Tokenizer(load_tokenizer()[1].tok, (0,), chat_template=LLAMA_LIKE)
    assert tok.renders_tools
    messages, tools = render_messages(body.messages, plan_tools(body), tok.renders_tools)
    text = tok.apply_chat_template(messages, tools=tools)
    assert '"name": "get_weather"' in text.splitlines()[0]  # the tool, with the first turn
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in text
    assert "<|tool|>12 C, rain" in text


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
    ],
)
def test_auto_replies_parse_into_calls(reply: str) -> None:
    calls = parse_calls(reply, _plan(tools=[WEATHER, CLOCK]))
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    msg = reply_message(reply, _plan(tools=[WEATHER, CLOCK]))
    sdk = ChatCompletionMessage.model_validate(msg.model_dump())
    assert sdk.content is None and sdk.tool_calls[0].id.startswith("call_")
    assert len(parse_calls(reply, _plan(tools=[WEATHER, CLOCK], parallel_tool_calls=False))) == 1


@pytest.mark.parametrize("reply", ["It is sunny.", '{"name": "unknown_fn", "arguments": {}}',
                                   'Sure: <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',
                                   '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'])
def test_anything_else_is_content(reply: str) -> None:
    assert parse_calls(reply, _plan(tools=[WEATHER])) is None
    assert reply_message(reply, _plan(tools=[WEATHER])).content == reply


def _chunks(stream: ToolStream, parts: list[str]) -> list[ChatCompletionChunk]:
    deltas = [d for p in parts for d in stream.push(p)] + stream.end()
    return [ChatCompletionChunk.model_validate({
        "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": d.model_dump(), "finish_reason": None}]}) for d in deltas]


def test_streams() -> None:
    named = _plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = _chunks(ToolStream(named), ['{"city"', ': "Os', 'lo"}'])
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == '{"city": "Oslo"}'

    auto = _plan(tools=[WEATHER])
    stream = ToolStream(auto)
    assert stream.push("<tool") == [] and stream.push('_call>{"name": "get_weather",') == []
    stream.push(' "arguments": {"city": "Oslo"}}</tool_call>')
    [end] = stream.end()
    assert stream.called and end.tool_calls[0].function.arguments == '{"city": "Oslo"}'

    text = ToolStream(auto)
    assert [d.content for d in text.push("It")] == ["It"] and text.push(" rains")[0].content == " rains"
    assert text.end() == [] and not text.called
