"""What pd and colocated send per response: `Chunk`s, streamed one by one or collected per choice.

Each chunk carries up to `CONTEXT` ids that precede its tokens (more with stop strings:
`context_len`), so the stateless postprocess of the llm ensemble can detokenize streaming-safely
(`rngd_pd.stubs.text_models.text_delta`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rngd_pd import errors
from rngd_pd.model.params import TokenLogprobs

CONTEXT = 8  # ids of left context a stateless detokenizer needs (a UTF-8 char spans <= 4 tokens)


@dataclass(frozen=True)
class Chunk:
    """One response of pd: new token ids, the ids before them, and the finish reason on the last.

    With n > 1 each chunk belongs to one choice (`index`), and only the request's last is `final`
    (`last`; None: the finish reason says it, n = 1). `logprobs`: one row per token id when asked
    for; `prompt_logprobs` on the first chunk of choice 0 when asked for."""

    token_ids: list[int]
    context_ids: list[int]
    finish_reason: str = ""
    index: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    last: bool | None = None

    @property
    def final(self) -> bool:
        return bool(self.finish_reason) if self.last is None else self.last


def context_len(stop: tuple[str, ...] | list[str]) -> int:
    """Preceding ids a chunk carries: CONTEXT, plus room for postprocess to hold back the tail that
    could still become a stop string (the longest one less a character, <= 4 tokens per character)."""
    return CONTEXT + 4 * max((len(s) for s in stop), default=0)


class ChunkEmitter:
    """Streams chunks one by one, or (stream=False) collects each choice into one chunk, sent when
    every choice of the request has ended (the last one final)."""

    def __init__(self, stream: bool, emit: Callable[[Chunk], None], context: int = CONTEXT,
                 n: int = 1) -> None:
        self.stream, self.emit, self.context, self.n = stream, emit, context, n
        self.choices: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[TokenLogprobs] | None] = [None] * n
        self._prompt: list[TokenLogprobs] | None = None
        self._reasons: dict[int, str] = {}

    @property
    def ids(self) -> list[int]:
        """Every id generated, over all choices."""
        return [i for choice in self.choices for i in choice]

    @property
    def done(self) -> bool:
        return len(self._reasons) == self.n

    def add(self, ids: list[int], reason: str = "", index: int = 0,
            logprobs: list[TokenLogprobs] | None = None,
            prompt: list[TokenLogprobs] | None = None) -> None:
        if not 0 <= index < self.n or index in self._reasons:
            raise errors.RngdPdError(f"a response for choice {index} of {self.n} after its end")
        mine = self.choices[index]
        context = mine[-self.context:]
        mine.extend(ids)
        if reason:
            self._reasons[index] = reason
        last = None if self.n == 1 else self.done
        if self.stream:
            if ids or reason or prompt:
                self.emit(Chunk(ids, context, reason, index, logprobs, prompt, last))
            return
        if logprobs is not None:
            self._logprobs[index] = (self._logprobs[index] or []) + logprobs
        self._prompt = prompt if prompt is not None else self._prompt
        if self.done:
            for i in range(self.n):
                self.emit(Chunk(list(self.choices[i]), [], self._reasons[i], i, self._logprobs[i],
                                self._prompt if i == 0 else None, None if self.n == 1 else i == self.n - 1))
