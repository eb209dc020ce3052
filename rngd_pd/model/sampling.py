"""Sampling parameters, the per-request sampler and stop-string matching.

A request owns one `Sampler` with its own `torch.Generator`, so the tokens it draws depend only on
its seed and its own logits, never on which other requests share the batch. `StopChecker` watches the
streamed text: it holds back the tail that might still become a stop string, so a stop string spanning
several tokens is found and never leaks into the output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rngd_pd.model.grammar import TokenConstraint
from rngd_pd.model.params import FinishReason, SamplingParams, TokenLogprobs
from rngd_pd.model.stopping import StopChecker

__all__ = ["FinishReason", "Sampled", "Sampler", "SamplingParams", "StopChecker", "TokenLogprobs"]


@dataclass(frozen=True)
class Sampled:
    """One chosen token and, when the request asked, its logprobs (chosen first, then the top-k)."""

    token: int
    logprobs: TokenLogprobs | None = None


class Sampler:
    """Draws one token from one row of logits, with the request's own generator.

    The order on a row (docs/frontend.md, "Sampling parameters"; vLLM v1's sampler):
    1. logprobs from the raw logits (log-softmax of the model's output, vLLM's `raw_logprobs`);
    2. `logit_bias`, min_tokens' ban of EOS and stop_token_ids, then the repetition penalty
       (prompt + output tokens: positive logits divided, negative ones multiplied), the frequency
       and presence penalties (output tokens: minus count x frequency, minus presence);
    3. greedy (argmax) at temperature 0, else logits / temperature, top-k, top-p (nucleus over the
       tokens that survive top-k), one draw.

    Draw n is seeded from (seed, n) alone, so a request's tokens depend on nothing but its seed and
    its logits: not on the batch, and not on whether its first token was drawn by a prefill engine in
    another process (`first_step=1` for the rest; `record` that token). Choice i of n uses seed + i.
    Not thread-safe: one sampler per choice.
    """

    def __init__(self, params: SamplingParams, first_step: int = 0, *, choice: int = 0,
                 prompt_ids: Sequence[int] = (), eos_ids: Sequence[int] = ()) -> None:
        self.params = params.for_choice(choice)  # valid by construction (rngd_pd.model.params)
        self.step = first_step
        self.generator = torch.Generator()
        self._base = self.params.seed if self.params.seed is not None else int(self.generator.seed())
        self._counts: dict[int, int] = {}  # output token -> how often it was chosen
        self._prompt = tuple(dict.fromkeys(prompt_ids)) if self.params.repetition_penalty != 1 else ()
        eos = () if self.params.ignore_eos else tuple(eos_ids)
        self._banned = tuple(dict.fromkeys((*eos, *self.params.stop_token_ids)))
        self.generated = 0

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def plain(self) -> bool:
        """The batch's argmax is this sampler's answer (see SamplingParams.plain)."""
        return self.params.plain

    def record(self, token: int) -> None:
        """Count a token of this choice's output that was chosen elsewhere (prefill's first token)."""
        self._counts[token] = self._counts.get(token, 0) + 1
        self.generated += 1

    def sample(self, logits: torch.Tensor, constraint: TokenConstraint | None = None) -> int:
        """logits [vocab] (any float dtype) -> token id. A `constraint` (structured outputs) masks the
        tokens its grammar forbids after the penalties, before temperature, top-k and top-p; the
        caller `accept`s the token it returns (rngd_pd.model.grammar gives the order)."""
        return self.choose(logits, constraint).token

    def choose(self, logits: torch.Tensor, constraint: TokenConstraint | None = None) -> Sampled:
        """logits [vocab] -> the token, with its logprobs when the request asked for them."""
        raw = torch.log_softmax(logits.float(), dim=-1) if self.params.logprobs is not None else None
        adjusted = self.adjust(logits)
        if constraint is not None:
            adjusted = constraint.mask_into(adjusted)
        token = self._draw(adjusted)
        self.record(token)
        if raw is None:
            return Sampled(token)
        return Sampled(token, top_logprobs(raw, token, self.params.logprobs or 0))

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """Step 2 of the class docstring: biases, min_tokens and penalties (a new fp32 row; the
        input itself when nothing applies)."""
        p = self.params
        if not p.adjusts_logits:
            return logits
        x = logits.float().clone()
        vocab = x.numel()
        if p.logit_bias:
            pairs = [(t, b) for t, b in p.logit_bias if t < vocab]
            if pairs:
                x[torch.tensor([t for t, _ in pairs])] += torch.tensor([b for _, b in pairs])
        if self.generated < p.min_tokens and self._banned:
            x[torch.tensor([t for t in self._banned if t < vocab], dtype=torch.long)] = -math.inf
        if p.repetition_penalty != 1:
            seen = torch.tensor(list(dict.fromkeys((*self._prompt, *self._counts))), dtype=torch.long)
            if seen.numel():
                v = x[seen]
                x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and self._counts:
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            x[ids] -= counts * p.frequency_penalty + p.presence_penalty
        return x

    def _draw(self, logits: torch.Tensor) -> int:
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


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """A row of log-probabilities [vocab] -> `token`'s logprob and the k largest (descending)."""
    values, ids = torch.topk(logprobs, k) if k else (logprobs[:0], torch.zeros(0, dtype=torch.long))
    return TokenLogprobs((token, *ids.tolist()), (float(logprobs[token]), *values.tolist()))


def prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Logits [N, vocab] of N positions and the N tokens that followed them -> each target's
    logprob and the top k at its position (the raw log-softmax, like the sampled tokens')."""
    rows = torch.log_softmax(logits.float(), dim=-1)
    return [top_logprobs(rows[i], int(t), k) for i, t in enumerate(targets)]


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
