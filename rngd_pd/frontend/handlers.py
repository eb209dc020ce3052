"""Request handling shared by /v1/completions and /v1/chat/completions.

Each endpoint only turns its body into prompt token ids and says how its chunks look
(`rngd_pd.frontend.frames`); admission, streaming, cancellation, usage and metrics are the same code
for both.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from rngd_pd.errors import ConfigError
from rngd_pd.frontend.api_errors import APIError, bad_request
from rngd_pd.frontend.backend import GenerateRequest
from rngd_pd.frontend.constraints import structured_of
from rngd_pd.frontend.frames import ChatFrames, CompletionFrames, Echo, Frames, tool_reason
from rngd_pd.frontend.generation import Piece, TextGeneration
from rngd_pd.frontend.logprob_format import CompletionLogprobBuilder, TokenText, chat_logprobs, merged
from rngd_pd.frontend.prompts import chat_prompt, completion_prompt, resolve_max_tokens
from rngd_pd.frontend.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    Usage,
    _GenerationRequest,
)
from rngd_pd.frontend.state import FrontendState
from rngd_pd.frontend.streaming import DONE, ClientGone, SSEResponse, sse, until_disconnect
from rngd_pd.frontend.tools import ToolPlan, plan_tools, reply_message
from rngd_pd.model.params import PREFILLER_HEADER, SamplingParams, prefiller_address
from rngd_pd.model.structured import Structured

CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody receives it
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


def _check_model(state: FrontendState, name: str) -> None:
    if name != state.model.name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{state.model.name}'",
            param="model",
            code="model_not_found",
        )


def _structured(body: _GenerationRequest, plan: ToolPlan) -> Structured | None:
    """The grammar of the reply: an enforced tool choice's, or the structured output asked for."""
    found = structured_of(body)
    if plan.structured is not None and found is not None:
        raise APIError(400, f"'{found[1]}' cannot be combined with tool_choice '{plan.mode}'",
                       param=found[1], code="invalid_value")
    return plan.structured or (found[0] if found else None)


def _sampling(body: _GenerationRequest, max_tokens: int, logprobs: int | None,
              prompt_logprobs: int | None = None, structured: Structured | None = None) -> SamplingParams:
    """The request's SamplingParams, built (and so checked) here once: the typed object goes on to the
    backend, which only encodes it."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(0, body.top_k or 0),
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            structured=structured.to_json() if structured is not None else None,
            n=body.n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.bias_pairs(),
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
        )
    except ConfigError as exc:  # what the schema cannot say alone (min_tokens > max_tokens)
        raise bad_request(exc.message, "min_tokens", "invalid_value") from None


def _check_token_ids(state: FrontendState, body: _GenerationRequest) -> None:
    """400 for a logit_bias or stop_token_ids id outside the vocabulary."""
    vocab = state.model.vocab_size
    for param, ids in (("logit_bias", [t for t, _ in body.bias_pairs()]),
                       ("stop_token_ids", body.stop_token_ids or [])):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in '{param}' is outside the vocabulary [0, {vocab})", param,
                              "invalid_value")


def _usage(gens: list[TextGeneration]) -> Usage:
    prompt = sum(g.prompt_tokens for g in gens)
    completion = sum(g.completion_tokens for g in gens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _prefill_at(request: Request) -> str | None:
    """The prefill server llm-d's endpoint picker chose (`x-prefiller-host-port`), checked; None
    without the header (pd then prefills on its configured server)."""
    value = request.headers.get(PREFILLER_HEADER)
    return prefiller_address(value) if value else None


async def completion(state: FrontendState, body: CompletionRequest, request: Request) -> Any:
    _check_model(state, body.model)
    _check_token_ids(state, body)
    model = await state.context_model()
    rid = f"cmpl-{uuid.uuid4().hex}"
    tokenizer = state.model.tokenizer
    prompt_lp = body.logprobs if body.echo else None
    structured = _structured(body, ToolPlan())
    gens, echoes = [], []
    for i, prompt in enumerate(body.prompts()):
        ids = completion_prompt(model, prompt)
        max_tokens = resolve_max_tokens(model, len(ids), body.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt")
        params = _sampling(body, max_tokens, body.logprobs, prompt_lp if len(ids) > 1 else None, structured)
        gens.append(TextGeneration(state.backend, tokenizer,
                                   GenerateRequest(f"{rid}-{i}", ids, params, _prefill_at(request)),
                                   arrival=request.scope.get(ARRIVAL_KEY)))
        text = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else None
        echoes.append(Echo(text, ids))
    frames = CompletionFrames(rid, body.model, echoes, body.logprobs, TokenText(tokenizer))
    if body.stream:
        return await _stream(state, request, gens, frames, body.include_usage())
    if not await _collect(state, request, gens):
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for g, gen in enumerate(gens):
        for c, choice in enumerate(gen.choices):
            index = g * body.n + c
            echo = echoes[g]
            lp = None
            if body.logprobs is not None:
                builder = CompletionLogprobBuilder(frames.text)
                parts = [builder.prompt(echo.ids, gen.prompt_logprobs)] if echo.text is not None else []
                lp = merged([*parts, builder.tokens(choice.logprobs)])
            choices.append(CompletionChoice(index=index, text=(echo.text or "") + choice.text, logprobs=lp,
                                            finish_reason=choice.finish_reason))
    return CompletionResponse(id=rid, created=int(time.time()), model=body.model, choices=choices,
                              usage=_usage(gens))


async def chat(state: FrontendState, body: ChatCompletionRequest, request: Request) -> Any:
    _check_model(state, body.model)
    _check_token_ids(state, body)
    model = await state.context_model()
    plan = plan_tools(body)
    structured = _structured(body, plan)
    ids = chat_prompt(model, body.messages, plan)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = resolve_max_tokens(model, len(ids), requested, None, "messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    top = (body.top_logprobs or 0) if body.logprobs else None
    gen = TextGeneration(
        state.backend,
        state.model.tokenizer,
        GenerateRequest(rid, ids, _sampling(body, max_tokens, top, None, structured), _prefill_at(request)),
        arrival=request.scope.get(ARRIVAL_KEY),
    )
    text = TokenText(state.model.tokenizer)
    if body.stream:
        return await _stream(state, request, [gen], ChatFrames(rid, body.model, body.n, top, text, plan),
                             body.include_usage())
    if not await _collect(state, request, [gen]):
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for i, c in enumerate(gen.choices):
        message = reply_message(c.text, plan) if plan.parses else AssistantMessage(content=c.text)
        reason = tool_reason(c.finish_reason, bool(message.tool_calls))  # type: ignore[arg-type]
        choices.append(ChatChoice(index=i, message=message, finish_reason=reason,
                                  logprobs=None if top is None else chat_logprobs(c.logprobs, top, text)))
    return ChatCompletionResponse(
        id=rid, created=int(time.time()), model=body.model, choices=choices, usage=_usage([gen])
    )


async def tokenize(state: FrontendState, body: TokenizeCompletionRequest | TokenizeChatRequest
                   ) -> TokenizeResponse:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template, as token ids."""
    if body.model is not None:
        _check_model(state, body.model)
    model = await state.context_model()
    if isinstance(body, TokenizeChatRequest):
        ids = chat_prompt(model, body.messages, add_generation_prompt=body.add_generation_prompt)
    else:
        ids = model.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=model.max_model_len, tokens=ids)


async def detokenize(state: FrontendState, body: DetokenizeRequest) -> DetokenizeResponse:
    """vLLM's /detokenize: token ids (each checked against the vocabulary) as text."""
    if body.model is not None:
        _check_model(state, body.model)
    vocab = state.model.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {bad} in 'tokens' is outside the vocabulary [0, {vocab})", "tokens",
                          "invalid_value")
    return DetokenizeResponse(prompt=state.model.tokenizer.decode(body.tokens))


ARRIVAL_KEY = "rngd_pd.arrival"  # ASGI scope key: perf_counter() when the request reached the app


def _admit(state: FrontendState) -> None:
    state.limiter.acquire()
    state.metrics.in_flight.inc()


def _retire(state: FrontendState, gens: list[TextGeneration], client_gone: bool) -> None:
    """Free the concurrency slot and record how the request's generations ended."""
    state.limiter.release()
    state.metrics.in_flight.dec()
    for gen in gens:
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


async def _run_all(gens: list[TextGeneration]) -> None:
    """Run every generation to its end (their texts and logprobs stay in their choices)."""
    await asyncio.gather(*(g.collect() for g in gens))


async def _collect(state: FrontendState, request: Request, gens: list[TextGeneration]) -> bool:
    """Run a non-streaming request to its end; False when the client went away (cancelled)."""
    _admit(state)
    gone = False
    try:
        await until_disconnect(request, _run_all(gens))
        return True
    except ClientGone:
        gone = True
        return False
    finally:
        _retire(state, gens, gone)


async def _merged(gens: list[TextGeneration]) -> AsyncIterator[tuple[TextGeneration, int, Piece]]:
    """Every generation's pieces as they come: (generation, choice index of the answer, piece);
    choice index = generation's place x n + the piece's choice. Closing it closes them all."""
    n = gens[0].req.params.n
    if len(gens) == 1:
        async for piece in gens[0].pieces():
            yield gens[0], piece.index, piece
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(g: int, gen: TextGeneration) -> None:
        try:
            async for piece in gen.pieces():
                await queue.put((gen, g * n + piece.index, piece))
        except Exception as exc:  # handed to the reader, which raises it
            await queue.put((gen, -1, exc))
        await queue.put((gen, -1, None))

    tasks = [asyncio.ensure_future(pump(g, gen)) for g, gen in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            gen, index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
                continue
            yield gen, index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def _stream(
    state: FrontendState, request: Request, gens: list[TextGeneration], frames: Frames, include_usage: bool
) -> Response:
    """Wait for the first piece (errors before it keep their status), then stream SSE."""
    _admit(state)
    it = _merged(gens)
    try:
        first = await until_disconnect(request, _first(it))
    except BaseException as exc:
        await it.aclose()
        _retire(state, gens, isinstance(exc, ClientGone))
        if isinstance(exc, ClientGone):
            return Response(status_code=CLIENT_CLOSED)
        raise

    async def events() -> AsyncIterator[bytes]:
        for frame in frames.start():
            yield frame
        try:
            if first is not None:
                for frame in frames.piece(*first):
                    yield frame
            async for gen, index, piece in it:
                frames_out = frames.piece(gen, index, piece)
                if piece.text:  # a chunk of text after the first
                    state.metrics.token_latency.observe(time.perf_counter() - gen.chunk_at)
                for frame in frames_out:
                    yield frame
        except APIError as exc:  # after the 200 went out, an error can only be an event
            yield sse(exc.body())
            yield DONE
            return
        if include_usage:
            yield frames.usage(_usage(gens))
        yield DONE

    async def on_close(completed: bool) -> None:
        await it.aclose()
        _retire(state, gens, not completed)

    return SSEResponse(events(), on_close)
