"""From streamed token ids to OpenAI text: detokenize incrementally, apply stop strings exactly,
count tokens and time them.

Stop strings: the server is told them too (so decode stops early), but the front end is the one that
cuts the text, because the server streams token ids and a stop string can end mid-token. Both sides
use `rngd_pd.model.stopping.StopChecker` over the same incremental detokenization of the generated
tokens, so they agree on where the match is; when the front end sees it first it closes the stream,
which cancels the request in Triton.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rngd_pd.errors import RngdPdError
from rngd_pd.frontend.api_errors import APIError
from rngd_pd.frontend.backend import Backend, GenerateRequest, TokenChunk
from rngd_pd.frontend.prompts import TokenizerLike
from rngd_pd.model.params import FinishReason, TokenLogprobs
from rngd_pd.model.stopping import StopChecker


@dataclass
class Timing:
    """perf_counter timestamps of one request (seconds), from its arrival at the front end."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    def tpot(self, n_tokens: int) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if n_tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (n_tokens - 1)


@dataclass
class Piece:
    """What one choice adds: its text delta, the logprobs of the tokens behind it (when asked for),
    and its finish reason when it ended here."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class _Choice:
    """One choice's text: incremental detokenization, stop strings, its token count and end."""

    def __init__(self, tokenizer: TokenizerLike, stop: tuple[str, ...], silent: frozenset[int]) -> None:
        self._decoder = tokenizer.stream_decoder()
        self._stop = StopChecker(stop)
        self._silent = silent  # EOS and stop_token_ids: counted, never text
        self.tokens = 0
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[TokenLogprobs] = []  # all of them (non-streaming answers)
        self.text = ""  # all of it

    def push(self, chunk: TokenChunk) -> Piece | None:
        """The piece a chunk of this choice makes (None: nothing to tell, or it had ended)."""
        if self.finish_reason is not None:
            return None  # ended here already (a stop string the front end saw first)
        out, rows = [], []
        for i, tid in enumerate(chunk.token_ids):
            self.tokens += 1
            if chunk.logprobs is not None:
                rows.append(chunk.logprobs[i])
            if tid in self._silent:
                continue  # the end marker is not text
            text, stopped = self._stop.push(self._decoder.push(tid))
            out.append(text)
            if stopped:
                self.finish_reason = FinishReason.STOP
                break
        if self.finish_reason is None and chunk.finish_reason:
            tail, stopped = self._stop.push(self._decoder.flush())
            out.append(tail + self._stop.flush())
            self.finish_reason = FinishReason.STOP if stopped else chunk.finish_reason
        self.logprobs += rows
        text = "".join(out)
        self.text += text
        if not (text or rows or self.finish_reason):
            return None
        return Piece(0, text, rows, self.finish_reason)


class TextGeneration:
    """One request's generation: iterate `pieces()` (or `text()` for one choice's text deltas), then
    read the results. With n > 1 the choices' pieces interleave, each with its index."""

    def __init__(
        self, backend: Backend, tokenizer: TokenizerLike, req: GenerateRequest, arrival: float | None = None
    ) -> None:
        self.backend, self.req = backend, req
        eos = () if req.params.ignore_eos else tokenizer.eos_token_ids
        silent = frozenset((*eos, *req.params.stop_token_ids))
        self.choices = [_Choice(tokenizer, req.params.stop, silent) for _ in range(req.params.n)]
        self.prompt_tokens = len(req.input_ids)
        self.prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # when the request asked
        self.timing = Timing() if arrival is None else Timing(start=arrival)
        self.sent_at: float | None = None  # when the Triton request went out (after preprocessing)
        self.chunk_at = 0.0  # arrival of the chunk behind the text last yielded

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)

    @property
    def finish_reason(self) -> FinishReason | None:
        """None until every choice has ended; then the first choice's (OpenAI's: `.openai`)."""
        if any(c.finish_reason is None for c in self.choices):
            return None
        return self.choices[0].finish_reason

    async def pieces(self) -> AsyncIterator[Piece]:
        """Yield each choice's pieces until every choice has ended (`finish_reason` is then set)."""
        stream = self.backend.generate(self.req)
        self.sent_at = time.perf_counter()
        try:
            async for chunk in stream:
                now = time.perf_counter()
                self.chunk_at = chunk.received_at or now
                if chunk.prompt_logprobs is not None:
                    self.prompt_logprobs = chunk.prompt_logprobs
                if chunk.token_ids and self.timing.first_token is None:
                    self.timing.first_token = now
                if chunk.token_ids:
                    self.timing.last_token = now
                if not 0 <= chunk.index < len(self.choices):
                    why = f"a response for choice {chunk.index} of {len(self.choices)}"
                    raise APIError.of(RngdPdError, why)
                piece = self.choices[chunk.index].push(chunk)
                if piece is not None:
                    piece.index = chunk.index
                    yield piece
                if self.finish_reason:
                    return
        finally:
            await stream.aclose()  # before the final chunk this cancels the Triton request

    async def text(self) -> AsyncIterator[str]:
        """Yield non-empty text deltas (of a request of one choice)."""
        async for piece in self.pieces():
            if piece.text:
                yield piece.text

    async def collect(self) -> list[str]:
        """Run to the end and return each choice's whole text (non-streaming requests)."""
        async for _ in self.pieces():
            pass
        return [c.text for c in self.choices]
