"""Tool calls: `tools` / `tool_choice` / `parallel_tool_calls` into the prompt and the grammar, and the
reply back into OpenAI's `tool_calls`, whole or streamed.

* **The prompt.** A chat template that knows tools (it mentions `tools`, as Llama 3.1+ templates do)
  gets them as Hugging Face passes them (`tools=[{"type": "function", "function": {...}}]`), assistant
  messages with `tool_calls` (arguments as objects) and `role: tool` messages as they are. A template
  that does not (the embedded SmolLM2's renders only role and content) would drop the tools silently,
  and the model would never know them; so the tools are described in the system message instead, with
  the reply format below, and earlier calls are written back in that format (`TOOL_PROMPT`).
* **The reply format** the prompt asks for and the parser reads: `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` (one per call, or a JSON list inside one), as Hermes/Qwen-style models write; the
  parser also reads Llama 3's bare `{"name": ..., "parameters": {...}}` (after `<|python_tag|>`,
  several separated by `;`).
* **Enforced choices.** `tool_choice` naming a function constrains the reply to that function's
  parameter schema (the reply *is* the arguments); `"required"` to a JSON list of
  `{"name", "arguments"}` objects, one per call (at most one with `parallel_tool_calls: false`), as vLLM
  does; so the arguments always parse and match the schema. `"auto"` is not constrained: the model
  decides, and a reply that is not a well-formed call is content. `"none"` renders the tools but never
  parses a call (vLLM's default).
* **Streaming.** A named call streams its arguments as they are generated; a `required` or `auto` call
  is sent as one delta (id, name and the whole arguments) when its JSON is complete; text that cannot
  start a call streams as content at once.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from rngd_pd.frontend.api_errors import bad_request
from rngd_pd.frontend.constraints import checked
from rngd_pd.frontend.schemas import (
    AssistantMessage,
    AssistantTurn,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolMessage,
)
from rngd_pd.model.structured import Structured

Mode = Literal["none", "auto", "required", "named"]
OPEN, CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_EMPTY_PARAMS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_PROMPT = (
    "You can call functions. The functions you can call are listed inside <tools></tools> as JSON:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with nothing but one line per call in this format:\n"
    '<tool_call>{{"name": <function name>, "arguments": <JSON object of its arguments>}}</tool_call>\n'
    "If no function fits the request, answer in plain text."
)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools, checked; `structured` is the grammar an enforced choice
    puts on the reply (None for none / auto)."""

    mode: Mode = "none"
    tools: tuple[Tool, ...] = ()
    named: str | None = None
    parallel: bool = True
    structured: Structured | None = None

    @property
    def parses(self) -> bool:
        return self.mode != "none"


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan; 400 naming the parameter when it cannot be served."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice", "invalid_value")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("function names in 'tools' must be unique", "tools", "invalid_value")
    schemas = {t.function.name: checked(_params(t), "tools").value for t in tools}
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto"):
        return ToolPlan(choice or "auto", tools, parallel=parallel)  # type: ignore[arg-type]
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise bad_request(f"tool_choice names '{name}', which is not in 'tools' ({', '.join(names)})",
                              "tool_choice", "invalid_value")
        tool = tools[names.index(name)]
        return ToolPlan("named", tools, name, parallel, checked(_params(tool), "tools"))
    calls = {"anyOf": [_call_schema(n, s) for n, s in schemas.items()]}
    array: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return ToolPlan("required", tools, None, parallel, checked(Structured("json_schema", array), "tools"))


def _params(tool: Tool) -> Structured:
    return Structured("json_schema", tool.function.parameters or _EMPTY_PARAMS,
                      strict=bool(tool.function.strict))


def _call_schema(name: str, params: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


# ---- the prompt ----------------------------------------------------------------------------------


def render_messages(
    messages: list[ChatMessage], plan: ToolPlan, template_knows_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages (and the `tools` argument) for the chat template; see the module docstring."""
    out = [_message(m, template_knows_tools) for m in messages]
    if not plan.tools:
        return out, None
    specs = [t.model_dump(exclude_none=True) for t in plan.tools]
    if template_knows_tools:
        return out, specs
    described = TOOL_PROMPT.format(tools="\n".join(json.dumps(s["function"]) for s in specs))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out, None


def _message(m: ChatMessage, template_knows_tools: bool) -> dict[str, Any]:
    role = "system" if m.role == "developer" else m.role
    msg: dict[str, Any] = {"role": role, "content": m.text()}
    if isinstance(m, ToolMessage):
        msg["tool_call_id"] = m.tool_call_id
    if not isinstance(m, AssistantTurn) or not m.tool_calls:
        return msg
    functions = [{"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}
                 for c in m.tool_calls]
    if template_knows_tools:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": f}
                             for c, f in zip(m.tool_calls, functions, strict=True)]
        return msg
    calls = "\n".join(f"{OPEN}{json.dumps(f)}{CLOSE}" for f in functions)
    msg["content"] = f"{msg['content']}\n{calls}" if msg["content"] else calls
    return msg


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# ---- the reply -----------------------------------------------------------------------------------


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(text: str, plan: ToolPlan) -> list[FunctionCall] | None:
    """The tool calls a reply makes under `plan`, or None when it is content."""
    if plan.mode == "named":
        return [FunctionCall(name=plan.named or "", arguments=text.strip())]
    if plan.mode == "required":
        items = _loads_or_text(text)
        calls = _calls(items if isinstance(items, list) else [], plan)
    elif plan.mode == "auto":
        calls = _calls(_call_objects(text), plan)
    else:
        return None
    if calls and not plan.parallel:
        calls = calls[:1]
    return calls or None


def _call_objects(text: str) -> list[Any]:
    """JSON objects of the call formats the module docstring names; [] when the text is not one."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if OPEN in body:
        if body[: body.index(OPEN)].strip():
            return []  # text before the call: content that mentions a call, not a call
        parts = [p.split(CLOSE, 1) for p in body.split(OPEN)[1:]]
        if any(len(p) > 1 and p[1].strip() for p in parts):
            return []
        pieces = [p[0] for p in parts]
    else:
        pieces = [body] if body.startswith(("{", "[")) else []
        if pieces and isinstance(_loads_or_text(body), str):
            pieces = body.split(";")  # Llama 3: several calls separated by ';'
    out: list[Any] = []
    for piece in pieces:
        doc = _loads_or_text(piece.strip())
        if isinstance(doc, str):
            return []
        out.extend(doc if isinstance(doc, list) else [doc])
    return out


def _calls(objects: list[Any], plan: ToolPlan) -> list[FunctionCall]:
    names = {t.function.name for t in plan.tools}
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _loads_or_text(args)
        if not isinstance(args, dict):
            return []
        calls.append(FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)))
    return calls


def reply_message(text: str, plan: ToolPlan) -> AssistantMessage:
    """The whole reply as the assistant message (non-streaming)."""
    calls = parse_calls(text, plan)
    if calls is None:
        return AssistantMessage(content=text)
    return AssistantMessage(content=None, tool_calls=[ToolCall(id=call_id(), function=c) for c in calls])


@dataclass
class ToolStream:
    """A streamed reply as OpenAI chat deltas: content, or tool-call deltas (module docstring)."""

    plan: ToolPlan
    called: bool = False
    _held: list[str] = field(default_factory=list)
    _passing: bool = False  # auto: the reply turned out to be content; pass it through

    def push(self, text: str) -> list[ChatDelta]:
        mode = self.plan.mode
        if mode == "none" or self._passing:
            return [ChatDelta(content=text)]
        if mode == "named":
            first = not self.called
            self.called = True
            fn = FunctionCallDelta(name=self.plan.named if first else None, arguments=text)
            return [ChatDelta(tool_calls=[ToolCallDelta(
                index=0, id=call_id() if first else None, type="function" if first else None, function=fn)])]
        self._held.append(text)
        if mode == "auto" and not _may_be_call("".join(self._held)):
            self._passing = True
            held, self._held = "".join(self._held), []
            return [ChatDelta(content=held)]
        return []

    def end(self) -> list[ChatDelta]:
        """What is still held back, when the reply has ended."""
        held, self._held = "".join(self._held), []
        if self.plan.mode in ("none", "named") or self._passing:
            return []
        calls = parse_calls(held, self.plan)
        if calls is None:
            return [ChatDelta(content=held)] if held else []
        self.called = True
        return [ChatDelta(tool_calls=[ToolCallDelta(
            index=i, id=call_id(), type="function",
            function=FunctionCallDelta(name=c.name, arguments=c.arguments))]) for i, c in enumerate(calls)]


def _may_be_call(text: str) -> bool:
    """Whether text could still be the start of a tool call (so it is held back)."""
    t = text.lstrip()
    return not t or any(t.startswith(p) or p.startswith(t) for p in (OPEN, PYTHON_TAG, "{", "["))
