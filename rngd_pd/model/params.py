"""What a request asks of generation: `SamplingParams` and the finish reasons.

A `SamplingParams` is valid by construction: each process builds it once at its edge (the front end
from the HTTP body, a stub from its input tensors through `rngd_pd.wire.inputs`) and carries the typed
object inward, so nothing further in needs to check it again. Torch-free, so the OpenAI front end (a
gateway pod without weights) can build and forward it without importing torch;
`rngd_pd.model.sampling` re-exports these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

from rngd_pd.errors import ConfigError

PREFILLER_HEADER = "x-prefiller-host-port"
"""llm-d's endpoint picker names the prefill server it chose for a request in this HTTP header; the
front end passes it to pd as a request parameter of the same name, and pd prefills the request on
that server's gRPC endpoint."""


def prefiller_address(value: str) -> str:
    """`host:port` as the header gives it, checked (ConfigError naming the header otherwise)."""
    host, sep, port = value.strip().rpartition(":")
    bad_host = not host or any(c in host for c in "/@ ")
    if not sep or bad_host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{PREFILLER_HEADER} must be host:port of a prefill server's gRPC endpoint, "
                          f"got {value!r}")
    return f"{host}:{int(port)}"


MAX_N = 16  # choices per prompt (each takes a decode slot)
MAX_LOGPROBS = 20  # top logprobs per position, OpenAI's and vLLM's default limit

OpenAIFinishReason = Literal["stop", "length", "tool_calls"]
"""The finish reasons OpenAI's API answers with (of its set, the ones this server can end with)."""


class FinishReason(StrEnum):
    """Why a request ended: the one set of names every part uses (engine events, the `finish_reason`
    tensor of decode / pd / llm, the front end); a StrEnum, so each is also its wire string. A request
    that has not finished has no reason: None, never a member."""

    LENGTH = "length"        # max_tokens reached
    STOP = "stop"            # a stop string matched
    EOS = "eos"              # the model ended it (an end-of-sequence token)
    CANCELLED = "cancelled"  # the client (or pd, after a failure) cancelled it
    ERROR = "error"          # it failed; the error travels with it
    TOOL_CALLS = "tool_calls"  # the front end parsed the reply into tool calls (never on the wire)

    @property
    def openai(self) -> OpenAIFinishReason:
        """OpenAI's spelling: "length" when max_tokens ended the request, "tool_calls" when the reply
        became tool calls, "stop" for every other end (OpenAI's "stop" is any natural end: an EOS
        token as much as a stop string or a finished grammar)."""
        if self is FinishReason.LENGTH or self is FinishReason.TOOL_CALLS:
            return self.value  # type: ignore[return-value]
        return "stop"


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; checked when built (ConfigError naming the bad parameter)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    structured: str | None = None  # rngd_pd.model.structured.Structured.to_json(): the reply's grammar
    # OpenAI's and vLLM's extensions (docs/frontend.md, "Sampling parameters"): choices per prompt;
    # logprobs of each sampled token with its top-k alternatives (None: none; 0: the sampled token's
    # only), and of the prompt's tokens (prefill computes them only when asked); penalties and biases
    # applied to the raw logits before temperature; EOS and stop_token_ids banned for min_tokens.
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first bad parameter (a request must not reach the engine).
        Construction calls it, so an existing SamplingParams has passed it."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = disabled), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise ConfigError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if self.structured is not None and (not isinstance(self.structured, str) or not self.structured):
            raise ConfigError(f"structured must be a non-empty JSON text, got {self.structured!r}")
        self._validate_extensions()

    def _validate_extensions(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ConfigError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ConfigError(f"{name} must be null or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, tuple) or any(
            not isinstance(pair, tuple) or len(pair) != 2 or not _is_int(pair[0]) or pair[0] < 0
            or not _is_number(pair[1]) or not -100 <= pair[1] <= 100 for pair in self.logit_bias
        ):
            raise ConfigError("logit_bias must map token ids >= 0 to biases in [-100, 100], "
                              f"got {self.logit_bias!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                              f"got {self.min_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple) or any(
            not _is_int(t) or t < 0 for t in self.stop_token_ids
        ):
            raise ConfigError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when the next token is simply the argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """True when a penalty, a bias or min_tokens changes the logits before the draw."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    @property
    def plain(self) -> bool:
        """True when the batched argmax is the whole answer: greedy, nothing adjusted, no logprobs."""
        return self.greedy and not self.adjusts_logits and self.logprobs is None

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: the seed advanced by the index, as vLLM's parallel
        sampling does (so choice i of a seeded request is reproducible on its own)."""
        if index == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + index) % 2**64)


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities of one position: the chosen (or prompt) token first, then the top-k
    alternatives by descending logprob; `ids[i]` goes with `values[i]`."""

    ids: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def token(self) -> int:
        return self.ids[0]

    @property
    def logprob(self) -> float:
        return self.values[0]

    @property
    def top(self) -> tuple[tuple[int, float], ...]:
        return tuple(zip(self.ids[1:], self.values[1:], strict=True))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
