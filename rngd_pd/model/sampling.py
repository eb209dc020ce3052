"""Sampling parameters, the per-request sampler and stop-string matching.

A request owns one `Sampler` with its own `torch.Generator`, so the tokens it draws depend only on
its seed and its own logits, never on which other requests share the batch. `StopChecker` watches the
streamed text: it holds back the tail that might still become a stop string, so a stop string spanning
several tokens is found and never leaks into the output.
"""

from __future__ import annotations

import torch

from rngd_pd.model.grammar import TokenConstraint
from rngd_pd.model.params import FinishReason, SamplingParams
from rngd_pd.model.stopping import StopChecker

__all__ = ["FinishReason", "Sampler", "SamplingParams", "StopChecker"]


class Sampler:
    """Draws one token from one row of logits, with the request's own generator.

    Greedy at temperature 0. Otherwise logits / temperature, then top-k, then top-p (nucleus over the
    tokens that survive top-k), then one draw. Draw n is seeded from (seed, n) alone, so a request's
    tokens depend on nothing but its seed and its logits: not on the batch, and not on whether its
    first token was drawn by a prefill engine in another process (`first_step=1` for the rest).
    Not thread-safe: one sampler per request.
    """

    def __init__(self, params: SamplingParams, first_step: int = 0) -> None:
        self.params = params  # valid by construction (rngd_pd.model.params)
        self.step = first_step
        self.generator = torch.Generator()
        self._base = params.seed if params.seed is not None else int(self.generator.seed())

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def sample(self, logits: torch.Tensor, constraint: TokenConstraint | None = None) -> int:
        """logits [vocab] (any float dtype) -> token id. A `constraint` (structured outputs) masks the
        tokens its grammar forbids before temperature, top-k and top-p; the caller `accept`s the
        token it returns (rngd_pd.model.grammar gives the order)."""
        step, self.step = self.step, self.step + 1
        if constraint is not None:
            logits = constraint.mask_into(logits)
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
