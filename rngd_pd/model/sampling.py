"""Sampling parameters, the per-request sampler and stop-string matching.

A request owns one `Sampler` with its own `torch.Generator`, so the tokens it draws depend only on
its seed and its own logits, never on which other requests share the batch. `StopChecker` watches the
streamed text: it holds back the tail that might still become a stop string, so a stop string spanning
several tokens is found and never leaks into the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rngd_pd.errors import ConfigError

FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_EOS = "eos"


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler; `validate()` before use."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raise ConfigError naming the first bad parameter (a request must not reach the engine)."""
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

    @property
    def greedy(self) -> bool:
        """True when the next token is simply the argmax (temperature 0)."""
        return self.temperature == 0


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class Sampler:
    """Draws one token from one row of logits, with the request's own generator.

    Greedy at temperature 0. Otherwise logits / temperature, then top-k, then top-p (nucleus over the
    tokens that survive top-k), then one draw. Draw n is seeded from (seed, n) alone, so a request's
    tokens depend on nothing but its seed and its logits: not on the batch, and not on whether its
    first token was drawn by a prefill engine in another process (`first_step=1` for the rest).
    Not thread-safe: one sampler per request.
    """

    def __init__(self, params: SamplingParams, first_step: int = 0) -> None:
        params.validate()
        self.params = params
        self.step = first_step
        self.generator = torch.Generator()
        self._base = params.seed if params.seed is not None else int(self.generator.seed())

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def sample(self, logits: torch.Tensor) -> int:
        """logits [vocab] (any float dtype) -> token id."""
        step, self.step = self.step, self.step + 1
        if self.params.greedy:
            return int(torch.argmax(logits))
        p = self.params
        scaled = logits.float() / p.temperature
        indices = None  # None: probs index the whole vocabulary directly
        if 0 < p.top_k < scaled.numel():
            values, indices = torch.topk(scaled, p.top_k)  # sorted, descending
            probs = torch.softmax(values, dim=-1)
        else:
            probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            probs, indices = _nucleus(probs, indices, p.top_p)
        self.generator.manual_seed(_mix64(self._base, step))
        choice = int(torch.multinomial(probs, 1, generator=self.generator))
        return choice if indices is None else int(indices[choice])


def _nucleus(
    probs: torch.Tensor, indices: torch.Tensor | None, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest set of most likely tokens whose mass reaches top_p (at least one token).

    Without top-k the distribution is unsorted: rather than sorting the whole vocabulary (~6 ms for
    49k entries), take the top 256 and sort everything only when they hold less than top_p of the
    mass (flat distributions, high temperatures).
    """
    if indices is None:
        n = probs.numel()
        k = min(256, n)
        while True:
            values, idx = torch.topk(probs, k)  # sorted, descending
            cum = torch.cumsum(values, dim=-1)
            if float(cum[-1]) >= top_p or k == n:
                break
            k = n  # a flat distribution: sort it all
        probs, indices = values, idx
    else:
        cum = torch.cumsum(probs, dim=-1)
    keep = int(torch.searchsorted(cum, torch.tensor([top_p]), right=False)) + 1
    return probs[:keep], indices[:keep]


_M64 = 0xFFFF_FFFF_FFFF_FFFF


def _mix64(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): well-spread, deterministic per-draw seeds."""
    z = (seed + (step + 1) * 0x9E37_79B9_7F4A_7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return z ^ (z >> 31)


class StopChecker:
    """Finds stop strings in streamed text; the text it releases never contains (part of) one.

    push(delta) returns (text safe to emit, stopped). Once stopped, the returned text ends just
    before the stop string and later pushes return ("", True). flush() returns the held-back tail
    when the request ends for another reason (EOS, length).
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(stop)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        buf = self._pending + delta
        hit = min(((buf.find(s), s) for s in self.stop if s in buf), default=None)
        if hit is not None:
            idx, s = hit
            self.stopped, self.matched, self._pending = True, s, ""
            return buf[:idx], True
        hold = self._held_suffix_len(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
