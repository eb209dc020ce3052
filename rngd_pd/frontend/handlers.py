"""Request handling shared by /v1/completions and /v1/chat/completions.

Each endpoint only turns its body into prompt token ids and says how its chunks look (`Frames`);
admission, streaming, cancellation, usage and metrics are the same code for both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from rngd_pd.frontend.api_errors import APIError
from rngd_pd.frontend.backend import GenerateRequest
from rngd_pd.frontend.constraints import structured_of
from rngd_pd.frontend.generation import TextGeneration
from rngd_pd.frontend.prompts import chat_prompt, completion_prompt, resolve_max_tokens
from rngd_pd.frontend.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    _GenerationRequest,
)
from rngd_pd.frontend.state import FrontendState
from rngd_pd.frontend.streaming import DONE, ClientGone, SSEResponse, sse, until_disconnect
from rngd_pd.frontend.tools import ToolPlan, ToolStream, plan_tools, reply_message
from rngd_pd.model.params import PREFILLER_HEADER, FinishReason, SamplingParams, prefiller_address
from rngd_pd.model.structured import Structured

CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody receives it
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


class Frames:
    """How one endpoint's stream chunks look; subclasses fill in the payloads."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())

    def start(self) -> list[bytes]:
        return []

    def delta(self, text: str) -> bytes:
        """The events of a text delta (b"" when it is held back)."""
        raise NotImplementedError

    def final(self, reason: FinishReason) -> bytes:
        raise NotImplementedError

    def usage(self, usage: Usage) -> bytes:
        raise NotImplementedError


class CompletionFrames(Frames):
    def __init__(self, rid: str, model: str, echo: str | None) -> None:
        super().__init__(rid, model)
        self.echo = echo

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse(
            CompletionResponse(
                id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
            )
        )

    def start(self) -> list[bytes]:
        return [self.delta(self.echo)] if self.echo else []

    def delta(self, text: str) -> bytes:
        return self._chunk([CompletionChoice(text=text, finish_reason=None)])

    def final(self, reason: FinishReason) -> bytes:
        return self._chunk([CompletionChoice(text="", finish_reason=reason)])

    def usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)


class ChatFrames(Frames):
    def __init__(self, rid: str, model: str, tools: ToolStream) -> None:
        super().__init__(rid, model)
        self.tools = tools

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
            )
        )

    def start(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def delta(self, text: str) -> bytes:
        return b"".join(self._chunk([ChatChunkChoice(delta=d)]) for d in self.tools.push(text))

    def final(self, reason: FinishReason) -> bytes:
        held = b"".join(self._chunk([ChatChunkChoice(delta=d)]) for d in self.tools.end())
        reason = _tool_reason(reason, self.tools.called)
        return held + self._chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)])

    def usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)


def _check_model(state: FrontendState, name: str) -> None:
    if name != state.model.name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{state.model.name}'",
            param="model",
            code="model_not_found",
        )


def _tool_reason(reason: FinishReason, called: bool) -> FinishReason:
    """"tool_calls" when the reply became tool calls (unless max_tokens cut it)."""
    return FinishReason.TOOL_CALLS if called and reason is not FinishReason.LENGTH else reason


def _structured(body: _GenerationRequest, plan: ToolPlan) -> Structured | None:
    """The grammar of the reply: an enforced tool choice's, or the structured output asked for."""
    found = structured_of(body)
    if plan.structured is not None and found is not None:
        raise APIError(400, f"'{found[1]}' cannot be combined with tool_choice '{plan.mode}'",
                       param=found[1], code="invalid_value")
    return plan.structured or (found[0] if found else None)


def _sampling(
    body: _GenerationRequest, max_tokens: int, structured: Structured | None = None
) -> SamplingParams:
    """The request's SamplingParams, built (and so checked) here once: the typed object goes on to the
    backend, which only encodes it."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stop=body.stop_strings(),
        ignore_eos=body.ignore_eos,
        structured=structured.to_json() if structured is not None else None,
    )


def _usage(gen: TextGeneration) -> Usage:
    return Usage(
        prompt_tokens=gen.prompt_tokens,
        completion_tokens=gen.completion_tokens,
        total_tokens=gen.prompt_tokens + gen.completion_tokens,
    )


def _prefill_at(request: Request) -> str | None:
    """The prefill server llm-d's endpoint picker chose (`x-prefiller-host-port`), checked; None
    without the header (pd then prefills on its configured server)."""
    value = request.headers.get(PREFILLER_HEADER)
    return prefiller_address(value) if value else None


async def completion(state: FrontendState, body: CompletionRequest, request: Request) -> Any:
    _check_model(state, body.model)
    model = await state.context_model()
    ids = completion_prompt(model, body.prompt)
    max_tokens = resolve_max_tokens(model, len(ids), body.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    params = _sampling(body, max_tokens, _structured(body, ToolPlan()))
    gen = TextGeneration(
        state.backend,
        state.model.tokenizer,
        GenerateRequest(rid, ids, params, _prefill_at(request)),
        arrival=request.scope.get(ARRIVAL_KEY),
    )
    echo = None
    if body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else state.model.tokenizer.decode(ids)
    if body.stream:
        return await _stream(
            state, request, gen, CompletionFrames(rid, body.model, echo), body.include_usage()
        )
    text = await _collect(state, request, gen)
    if text is None:
        return Response(status_code=CLIENT_CLOSED)
    choice = CompletionChoice(text=(echo or "") + text, finish_reason=gen.finish_reason)
    return CompletionResponse(
        id=rid, created=int(time.time()), model=body.model, choices=[choice], usage=_usage(gen)
    )


async def chat(state: FrontendState, body: ChatCompletionRequest, request: Request) -> Any:
    _check_model(state, body.model)
    model = await state.context_model()
    plan = plan_tools(body)
    structured = _structured(body, plan)
    ids = chat_prompt(model, body.messages, plan)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(model, len(ids), requested, None, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = TextGeneration(
        state.backend,
        state.model.tokenizer,
        GenerateRequest(rid, ids, _sampling(body, max_tokens, structured), _prefill_at(request)),
        arrival=request.scope.get(ARRIVAL_KEY),
    )
    if body.stream:
        frames = ChatFrames(rid, body.model, ToolStream(plan))
        return await _stream(state, request, gen, frames, body.include_usage())
    text = await _collect(state, request, gen)
    if text is None:
        return Response(status_code=CLIENT_CLOSED)
    message = reply_message(text, plan) if plan.parses else AssistantMessage(content=text)
    reason = _tool_reason(gen.finish_reason, bool(message.tool_calls))  # type: ignore[arg-type]
    choice = ChatChoice(message=message, finish_reason=reason)
    return ChatCompletionResponse(
        id=rid, created=int(time.time()), model=body.model, choices=[choice], usage=_usage(gen)
    )


ARRIVAL_KEY = "rngd_pd.arrival"  # ASGI scope key: perf_counter() when the request reached the app


def _admit(state: FrontendState) -> None:
    state.limiter.acquire()
    state.metrics.in_flight.inc()


def _retire(state: FrontendState, gen: TextGeneration, client_gone: bool) -> None:
    """Free the concurrency slot and record how the request ended."""
    state.limiter.release()
    state.metrics.in_flight.dec()
    if gen.sent_at is not None:
        state.metrics.preprocess.observe(gen.sent_at - gen.timing.start)
    if gen.finish_reason is not None:
        state.metrics.finished(
            gen.prompt_tokens,
            gen.completion_tokens,
            gen.timing.ttft(),
            gen.timing.tpot(gen.completion_tokens),
            time.perf_counter() - gen.timing.start,
        )
    elif client_gone:
        state.metrics.cancelled.inc()


async def _collect(state: FrontendState, request: Request, gen: TextGeneration) -> str | None:
    """Whole text of a non-streaming request; None when the client went away (request cancelled)."""
    _admit(state)
    gone = False
    try:
        return await until_disconnect(request, gen.collect())
    except ClientGone:
        gone = True
        return None
    finally:
        _retire(state, gen, gone)


async def _first(it: AsyncIterator[str]) -> str | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def _stream(
    state: FrontendState, request: Request, gen: TextGeneration, frames: Frames, include_usage: bool
) -> Response:
    """Wait for the first token (errors before it keep their status), then stream SSE."""
    _admit(state)
    it = gen.text()
    try:
        first = await until_disconnect(request, _first(it))
    except BaseException as exc:
        await it.aclose()
        _retire(state, gen, isinstance(exc, ClientGone))
        if isinstance(exc, ClientGone):
            return Response(status_code=CLIENT_CLOSED)
        raise

    async def events() -> AsyncIterator[bytes]:
        for frame in frames.start():
            yield frame
        try:
            if first and (frame := frames.delta(first)):
                yield frame
            async for text in it:
                frame = frames.delta(text)
                state.metrics.token_latency.observe(time.perf_counter() - gen.chunk_at)
                if frame:
                    yield frame
        except APIError as exc:  # after the 200 went out, an error can only be an event
            yield sse(exc.body())
            yield DONE
            return
        yield frames.final(gen.finish_reason or FinishReason.STOP)
        if include_usage:
            yield frames.usage(_usage(gen))
        yield DONE

    async def on_close(completed: bool) -> None:
        await it.aclose()
        _retire(state, gen, not completed)

    return SSEResponse(events(), on_close)
