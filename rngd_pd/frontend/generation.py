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

from rngd_pd.frontend.backend import Backend, GenerateRequest
from rngd_pd.frontend.prompts import TokenizerLike
from rngd_pd.model.params import FinishReason
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


class TextGeneration:
    """One request's generation: iterate `text()` for the text deltas, then read the results."""

    def __init__(
        self, backend: Backend, tokenizer: TokenizerLike, req: GenerateRequest, arrival: float | None = None
    ) -> None:
        self.backend, self.req = backend, req
        self._decoder = tokenizer.stream_decoder()
        self._stop = StopChecker(req.params.stop)
        self._eos = frozenset(() if req.params.ignore_eos else tokenizer.eos_token_ids)
        self.prompt_tokens = len(req.input_ids)
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None  # None until it ends (OpenAI's: `.openai`)
        self.timing = Timing() if arrival is None else Timing(start=arrival)
        self.sent_at: float | None = None  # when the Triton request went out (after preprocessing)
        self.chunk_at = 0.0  # arrival of the chunk behind the text last yielded

    async def text(self) -> AsyncIterator[str]:
        """Yield non-empty text deltas; `finish_reason` is set when this ends normally."""
        stream = self.backend.generate(self.req)
        self.sent_at = time.perf_counter()
        try:
            async for chunk in stream:
                now = time.perf_counter()
                self.chunk_at = chunk.received_at or now
                if chunk.token_ids and self.timing.first_token is None:
                    self.timing.first_token = now
                text, stopped = self._push(chunk.token_ids)
                if chunk.token_ids:
                    self.timing.last_token = now
                if stopped:
                    self.finish_reason = FinishReason.STOP
                elif chunk.finish_reason:
                    tail, stopped = self._stop.push(self._decoder.flush())
                    text += tail + self._stop.flush()
                    self.finish_reason = FinishReason.STOP if stopped else chunk.finish_reason
                if text:
                    yield text
                if self.finish_reason:
                    return
        finally:
            await stream.aclose()  # before the final chunk this cancels the Triton request

    def _push(self, token_ids: tuple[int, ...]) -> tuple[str, bool]:
        out = []
        for tid in token_ids:
            self.completion_tokens += 1
            if tid in self._eos:
                continue  # the end marker is not text
            text, stopped = self._stop.push(self._decoder.push(tid))
            out.append(text)
            if stopped:
                return "".join(out), True
        return "".join(out), False

    async def collect(self) -> str:
        """Run to the end and return the whole text (non-streaming requests)."""
        return "".join([part async for part in self.text()])
