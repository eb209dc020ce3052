"""How a streamed answer looks: the SSE chunks of /v1/completions and /v1/chat/completions, one
choice's piece at a time (`rngd_pd.frontend.generation.Piece`), with its index, logprobs and, in chat,
its tool-call deltas (one `ToolStream` per choice)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rngd_pd.frontend.generation import Piece, TextGeneration
from rngd_pd.frontend.logprob_format import CompletionLogprobBuilder, TokenText, chat_logprobs
from rngd_pd.frontend.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Usage,
)
from rngd_pd.frontend.streaming import sse
from rngd_pd.frontend.tools import ToolPlan, ToolStream
from rngd_pd.model.params import FinishReason


class Frames:
    """How one endpoint's stream chunks look; subclasses fill in the payloads. `piece` turns one
    choice's piece into its chunks (a delta, and the choice's final chunk when it ended)."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())

    def start(self) -> list[bytes]:
        return []

    def piece(self, gen: TextGeneration, index: int, piece: Piece) -> list[bytes]:
        raise NotImplementedError

    def usage(self, usage: Usage) -> bytes:
        raise NotImplementedError


class CompletionFrames(Frames):
    """Completions: choice `index` of a batch is prompt index // n, its choice index % n."""

    def __init__(self, rid: str, model: str, echo: list[Echo], logprobs: int | None,
                 text: TokenText) -> None:
        super().__init__(rid, model)
        self.echo, self.logprobs, self.text = echo, logprobs, text
        self.builders: dict[int, CompletionLogprobBuilder] = {}
        self.echoed: set[int] = set()

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse(
            CompletionResponse(
                id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
            )
        )

    def piece(self, gen: TextGeneration, index: int, piece: Piece) -> list[bytes]:
        out = []
        builder = self.builders.setdefault(index, CompletionLogprobBuilder(self.text))
        echo = self.echo[index // gen.req.params.n]
        if echo.text is not None and index not in self.echoed:
            self.echoed.add(index)
            lp = builder.prompt(echo.ids, gen.prompt_logprobs) if self.logprobs is not None else None
            out.append(self._chunk([CompletionChoice(index=index, text=echo.text, logprobs=lp,
                                                     finish_reason=None)]))
        if piece.text or piece.logprobs:
            lp = builder.tokens(piece.logprobs) if self.logprobs is not None else None
            out.append(self._chunk([CompletionChoice(index=index, text=piece.text, logprobs=lp,
                                                     finish_reason=None)]))
        if piece.finish_reason:
            final = CompletionChoice(index=index, text="", finish_reason=piece.finish_reason)
            out.append(self._chunk([final]))
        return out

    def usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)


class ChatFrames(Frames):
    """Chat: each choice's text goes through its own `ToolStream` (content, or tool-call deltas);
    every chunk carries its choice's index."""

    def __init__(self, rid: str, model: str, n: int, top: int | None, text: TokenText,
                 plan: ToolPlan) -> None:
        super().__init__(rid, model)
        self.n, self.top, self.text = n, top, text
        self.tools = [ToolStream(plan) for _ in range(n)]

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage
            )
        )

    def start(self) -> list[bytes]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                for i in range(self.n)]

    def piece(self, gen: TextGeneration, index: int, piece: Piece) -> list[bytes]:
        tools = self.tools[index]
        deltas = tools.push(piece.text) if piece.text else []
        if piece.logprobs and not deltas:  # the text is held back (or there is none): the logprobs go now
            deltas = [ChatDelta() if tools.plan.parses else ChatDelta(content="")]
        lp = chat_logprobs(piece.logprobs, self.top, self.text) if self.top is not None and deltas else None
        out = [self._chunk([ChatChunkChoice(index=index, delta=d, logprobs=lp if j == 0 else None)])
               for j, d in enumerate(deltas)]
        if piece.finish_reason:
            out += [self._chunk([ChatChunkChoice(index=index, delta=d)]) for d in tools.end()]
            reason = tool_reason(piece.finish_reason, tools.called)
            out.append(self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)]))
        return out

    def usage(self, usage: Usage) -> bytes:
        return self._chunk([], usage)


@dataclass(frozen=True)
class Echo:
    """A completion prompt as echoed: its text (None: no echo) and ids."""

    text: str | None
    ids: list[int]


def tool_reason(reason: FinishReason, called: bool) -> FinishReason:
    """"tool_calls" when the reply became tool calls (unless max_tokens cut it)."""
    return FinishReason.TOOL_CALLS if called and reason is not FinishReason.LENGTH else reason
