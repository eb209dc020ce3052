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
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class TextFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Preferred over max_tokens.")
    logprobs: bool | None = Field(None, description="Log-probabilities of each token of the reply.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Alternatives per token (needs logprobs: true)."
    )
    tools: list[dict[str, Any]] | None = Field(None, max_length=0, description="Not supported.")
    tool_choice: Literal["none"] | None = Field(None, description='Not supported (null or "none").')
    functions: list[dict[str, Any]] | None = Field(None, max_length=0, description="Not supported.")
    function_call: Literal["none"] | None = Field(None, description='Not supported (null or "none").')
    parallel_tool_calls: None = Field(None, description="Not supported.")
    response_format: TextFormat | None = Field(None, description='Only {"type": "text"}.')

    @field_validator(
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "parallel_tool_calls",
        "response_format",
        mode="before",
    )
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
    content: str


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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
