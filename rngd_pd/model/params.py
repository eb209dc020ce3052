"""What a request asks of generation: `SamplingParams` and the finish reasons.

A `SamplingParams` is valid by construction: each process builds it once at its edge (the front end
from the HTTP body, a stub from its input tensors through `rngd_pd.wire.inputs`) and carries the typed
object inward, so nothing further in needs to check it again. Torch-free, so the OpenAI front end (a
gateway pod without weights) can build and forward it without importing torch;
`rngd_pd.model.sampling` re-exports these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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

    @property
    def greedy(self) -> bool:
        """True when the next token is simply the argmax (temperature 0)."""
        return self.temperature == 0


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
