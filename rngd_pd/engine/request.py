"""What the engines exchange with their callers, and the per-request token bookkeeping they share.

`RequestState` turns each sampled token into a `TokenEvent`: it detokenizes incrementally, watches
stop strings, EOS and max_tokens, and decides when the request is finished. The colocated and the
disaggregated paths use the same class, so they finish requests the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rngd_pd.errors import ConfigError, ContextLengthError
from rngd_pd.model.sampling import FinishReason, Sampled, SamplingParams, StopChecker, TokenLogprobs


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step of a request. Exactly one event per request has finished=True.

    token_id is None only on a final event that carries no token (cancel, error). text is the
    detokenized delta that is safe to show (stop strings and broken UTF-8 held back).
    """

    key: str
    token_id: int | None
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: BaseException | None = None
    index: int = 0  # the choice (of the request's n) this event belongs to
    logprobs: TokenLogprobs | None = None  # token_id's, when the request asked for logprobs


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    num_tokens: int
    kv: list[tuple[Any, Any]]  # per layer (K, V) [kv_heads, num_tokens, head_dim], on the device
    cached_tokens: int = 0  # leading prompt tokens whose KV came from the prefix cache
    first: list[Sampled] = field(default_factory=list)  # choice i's first token (and its logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # tokens 1.. of the prompt, when asked


FirstTokens = int | Sampled | Sequence[Sampled] | Sequence[int]
"""The first token of a request (choice 0), or of each of its n choices."""


@dataclass
class DecodeRequest:
    """A prefilled request handed to the DecodeEngine.

    load_kv(cache, slot) must write the prompt's KV (positions [0, prompt_len)) into the slot of
    every layer; it runs on a loader thread and may block on a transport. With a known first_token
    it is never called when that token already ends the request (the caller then releases the KV
    itself); with first_token None (it travels with the KV) load_kv returns it. With params.n > 1
    the first tokens are one per choice, and the engine copies the loaded KV into n slots.
    prompt_ids: the prompt, which the repetition penalty needs (empty otherwise).
    """

    key: str
    prompt_len: int
    first_token: FirstTokens | None
    params: SamplingParams
    load_kv: Callable[..., FirstTokens | None]
    emit: Callable[[TokenEvent], None]
    prompt_ids: Sequence[int] = ()


def choice_key(key: str, index: int) -> str:
    """The engine's key of choice `index` of a request (choice 0 keeps the request's)."""
    return key if index == 0 else f"{key}#{index}"


def first_tokens(value: FirstTokens | None, n: int, key: str) -> list[Sampled] | None:
    """`value` as one Sampled per choice (None stays None); ConfigError when the count is not n."""
    if value is None:
        return None
    if isinstance(value, int | Sampled):
        value = [value]
    firsts = [v if isinstance(v, Sampled) else Sampled(int(v)) for v in value]
    if len(firsts) != n:
        raise ConfigError(f"{len(firsts)} first tokens for a request of n={n} choices", key=key)
    return firsts


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only; an EOS that ended the request is included
    prompt_token_ids: list[int]
    text: str  # generated text without the stop string and without EOS
    finish_reason: str


def check_request(
    prompt_len: int, params: SamplingParams, max_context: int, key: str | None = None
) -> None:
    """Raise ConfigError / ContextLengthError before any compute is spent on a request (`params`
    was validated when it was built)."""
    if prompt_len < 1:
        raise ConfigError("the prompt is empty: give at least one token", key=key)
    if prompt_len + params.max_tokens > max_context:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
            f"{prompt_len + params.max_tokens} exceeds the context limit of {max_context} tokens; "
            "shorten the prompt or lower max_tokens",
            key=key,
        )


class RequestState:
    """Token-by-token finish logic of one request: EOS, stop strings, max_tokens, text deltas."""

    def __init__(self, key: str, params: SamplingParams, tokenizer, eos_token_ids: Sequence[int],
                 index: int = 0) -> None:
        self.key, self.index = key, index
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)  # end like EOS (no text), reason "stop"
        self._logprobs: TokenLogprobs | None = None  # the last token's
        self.decoder = tokenizer.stream_decoder()
        self.stop = StopChecker(params.stop)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finished = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def advance(self, token: int, logprobs: TokenLogprobs | None = None, end: bool = False) -> TokenEvent:
        """Account for one new token (and its logprobs, when asked for); the returned event says
        whether the request is done. `end`: the request's grammar admits nothing after this token (it
        finishes with reason "stop")."""
        self.token_ids.append(token)
        self._logprobs = logprobs
        if token in self.eos:
            return self._finish(token, FinishReason.EOS, "")
        if token in self.stop_ids:
            return self._finish(token, FinishReason.STOP, "", flush=True)
        text, stopped = self.stop.push(self.decoder.push(token))
        if stopped:
            return self._finish(token, FinishReason.STOP, text)
        if end:
            return self._finish(token, FinishReason.STOP, text, flush=True)
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish(token, FinishReason.LENGTH, text)
        self.text_parts.append(text)
        return TokenEvent(self.key, token, text, index=self.index, logprobs=logprobs)

    def final(self, reason: str, error: BaseException | None = None) -> TokenEvent | None:
        """The final event of a request ended from outside (cancel, error); no token. None when it
        had ended already (a choice of n that finished at its first token): its final event went out."""
        if self.finished:
            return None
        self.finished = True
        return TokenEvent(self.key, None, "", True, reason, error, index=self.index)

    def _finish(self, token: int, reason: str, text: str, flush: bool | None = None) -> TokenEvent:
        """flush (default: unless a stop string ended it): the held-back text goes out too."""
        if flush is None:
            flush = reason != FinishReason.STOP
        if flush:
            tail, stopped = self.stop.push(self.decoder.flush())
            text += tail
            if stopped:
                reason = FinishReason.STOP
            else:
                text += self.stop.flush()
        self.text_parts.append(text)
        self.finished = True
        return TokenEvent(self.key, token, text, True, reason, index=self.index, logprobs=self._logprobs)
