"""OpenAI request and response bodies as pydantic models: they validate requests and make the
OpenAPI schema honest (schemathesis checks every response against it).

Parameters the server does not implement are declared with their neutral value only (`best_of` = 1,
`suffix` empty, ...), in the schema too: any other value is a 400 that names the parameter, and
unknown parameters are refused (`extra="forbid"`), so nothing is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from rngd_pd.model.params import MAX_LOGPROBS, MAX_N, FinishReason, OpenAIFinishReason

UNSUPPORTED_CODE = "unsupported_parameter"
MAX_STOP_STRINGS = 16

MAX_PROMPTS = 64  # prompts in one /v1/completions request

# parameter -> the only values accepted (what clients send when they do not use the feature)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
}


def _refuse_unsupported(value: Any, name: str) -> Any:
    allowed = _NEUTRAL[name]
    if not any(
        value is ok or (value == ok and isinstance(value, bool) == isinstance(ok, bool)) for ok in allowed
    ):
        raise PydanticCustomError(
            UNSUPPORTED_CODE,
            "'{param}' = {value} is not supported by this server (only {allowed} is accepted)",
            {"param": name, "value": repr(value)[:40], "allowed": " or ".join(map(repr, allowed))},
        )
    return value


NonEmpty = Annotated[str, Field(min_length=1)]
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_STRINGS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="Send a last chunk with the usage of the request.")


Choices = Annotated[list[NonEmpty], Field(min_length=1)]


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field("response", max_length=64, description="OpenAI requires it; vLLM does not.")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="A JSON Schema.")
    strict: bool | None = Field(None, description="true: unsupported schema keywords are a 400.")


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (exactly one of these)."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json", description="A JSON Schema.")
    regex: NonEmpty | None = None
    choice: Choices | None = None
    grammar: NonEmpty | None = Field(None, description="Lark or GBNF (llama.cpp) grammar.")
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _GenerationRequest(_Strict):
    """Fields common to completions and chat completions."""

    model: str = Field(description="The served model name (see GET /v1/models).")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(
        None, ge=-1, description="Extension: keep the k most likely tokens; 0 or -1 = off."
    )
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description=f"Up to {MAX_STOP_STRINGS} non-empty strings."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS (benchmarks).")
    n: int = Field(1, ge=1, le=MAX_N, description=f"Choices per prompt (up to {MAX_N}), from one prefill.")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit."
    )
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(
        None, gt=0, description="Extension (vLLM): > 1 discourages tokens of the prompt and the output."
    )
    min_tokens: int = Field(0, ge=0, description="Extension (vLLM): no EOS or stop_token_ids before this.")
    stop_token_ids: StopTokenIds | None = Field(
        None, description="Extension (vLLM): token ids that end a choice (not part of its text)."
    )
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema.")
    guided_json: dict[str, Any] | bool | str | None = Field(None, description="vLLM: a JSON Schema.")
    guided_regex: NonEmpty | None = Field(None, description="vLLM: the reply matches this regex.")
    guided_choice: Choices | None = Field(None, description="vLLM: the reply is one of these.")
    guided_grammar: NonEmpty | None = Field(None, description="vLLM: a Lark or GBNF grammar.")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's newer form of guided_*.")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_bias_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            bad = next((k for k in value if not (isinstance(k, str) and k.isdigit())), None)
            if bad is not None:
                raise ValueError(f"logit_bias keys must be token ids, got {bad!r}")
        return value

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Prompt = NonEmpty | TokenIds


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""

    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
        description=f"A string or a list of token ids, or a batch of up to {MAX_PROMPTS} of either "
        "(choice i * n + j answers prompt i)."
    )
    echo: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Log-probabilities of each token and its top alternatives."
    )
    best_of: Literal[1] | None = Field(None, description="Not supported (null or 1).")
    suffix: Literal[""] | None = Field(None, description="Not supported (null or empty).")

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if value in ("", [], [""], [[]]) or (isinstance(value, list) and any(v in ("", []) for v in value)):
            raise ValueError("the prompt is empty; give at least one character or token id")
        batch = isinstance(value, list) and all(isinstance(v, str | list) for v in value)
        if batch and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    @field_validator("best_of", "suffix", mode="before")
    @classmethod
    def _neutral_only_completion(cls, value: Any, info: Any) -> Any:
        return _refuse_unsupported(value, info.field_name)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="The arguments as a JSON text.")


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(_Strict):
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class PlainMessage(_Message):
    role: Literal["system", "developer", "user"]


class AssistantTurn(_Message):
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = Field(None, description="The calls it made.")


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str = Field(description="The call this message answers.")


ChatMessage = Annotated[PlainMessage | AssistantTurn | ToolMessage, Field(discriminator="role")]


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Preferred over max_tokens.")
    logprobs: bool | None = Field(None, description="Log-probabilities of each token of the reply.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token (needs logprobs: true)."
    )
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default "auto" with tools, "none" without.'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call. Default true.")
    functions: list[dict[str, Any]] | None = Field(None, max_length=0, description="Deprecated; use tools.")
    function_call: Literal["none"] | None = Field(None, description='Deprecated; use tool_choice.')

    @field_validator("functions", "function_call", mode="before")
    @classmethod
    def _neutral_only_chat(cls, value: Any, info: Any) -> Any:
        return _refuse_unsupported(value, info.field_name)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# ---- responses -------------------------------------------------------------------------------------

OpenAIFinish = Annotated[
    FinishReason,
    PlainValidator(FinishReason),  # not the enum's own schema: the field keeps its title
    PlainSerializer(lambda reason: reason.openai, return_type=OpenAIFinishReason),
    WithJsonSchema({"enum": list(get_args(OpenAIFinishReason)), "type": "string"}),
]
"""Why a choice ended: the one enum, written and documented in OpenAI's spelling only."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token (an echoed
    prompt's first token has no logprob: null)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: OpenAIFinish | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinish


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of a tool call: `id`, `type` and the name come once, the arguments in parts."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinish | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rngd-pd"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class UpdateWeightsRequest(_Strict):
    """SGLang's /update_weights_from_disk body (its `load_format` and friends are not taken)."""

    model_path: str = Field(description="the new checkpoint directory on the server's host (same config)")
    drain_s: float = Field(120.0, gt=0, description="how long running requests may take to finish")


class UpdateWeightsResponse(BaseModel):
    success: bool
    message: str
    report: dict[str, Any] = Field(description="what changed: tensors, bytes read, fingerprints, seconds "
                                               "(rngd_pd.model.delta.DeltaReport and the switch's steps)")


class HealthResponse(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str = ""


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Strict):
    """POST /tokenize with chat messages, rendered by the model's chat template (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
