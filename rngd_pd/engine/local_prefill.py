"""Conditional disaggregation: up to which prompt length the decode instance prefills a request itself.

A hand-off costs a short prompt more than its prefill: a round trip to the prefill model, its queue
(behind long prompts), the KV push and pull. Prefilling it on the decode instance instead costs the
running streams the prefill's time on their cores (it runs on a loader thread beside the scheduler;
on a CPU host that shares its cores between the instances, it competes with the scheduler and with a
busy prefill instance). So a prompt is prefilled locally when its prefill takes at most
`budget_steps` (4) one-row decode steps, measured on this host at load: a stream loses at most about
that much once per local request, while the short request skips the queue and the hand-off. The
yardstick is a one-row step because it does not grow with `num_slots` (why, measured:
docs/benchmarks.md, "Conditional disaggregation, two fixes found here"). Dynamo
(`max_local_prefill_length`) and llm-d (the P/D decider's `threshold`) decide the same way, with a
configured length; here it is measured unless given.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from rngd_pd.model.sampling import SamplingParams

LENGTHS = (16, 32, 64, 128, 256, 512)
BUDGET_STEPS = 4.0


@dataclass(frozen=True)
class Threshold:
    """Prompts of at most `tokens` tokens are prefilled locally (0 = never); how it was found."""

    tokens: int
    reason: str
    step_s: float = 0.0
    prefill_s: dict[int, float] = field(default_factory=dict)


def _median_s(run: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(prefill: Any, decode: Any, budget_steps: float = BUDGET_STEPS,
            lengths: tuple[int, ...] = LENGTHS) -> Threshold:
    """The prompt length whose prefill (PrefillEngine) takes budget_steps one-row steps of the
    DecodeEngine `decode` (interpolated between the measured `lengths`); call before decode starts."""
    rows = 1
    step_s = decode.time_step(rows=rows)
    budget = budget_steps * step_s
    vocab, params = prefill.config.vocab_size, SamplingParams(max_tokens=1)
    timed: dict[int, float] = {}
    chosen, last = 0, (0, 0.0)
    for n in lengths:
        if n > prefill.max_context - 1:
            break
        ids = [(7 + 31 * i) % vocab for i in range(n)]

        def run(ids: list[int] = ids) -> None:
            prefill.prefill("calibrate", ids, params)

        run()
        timed[n] = _median_s(run, 2)
        if timed[n] > budget:
            n0, t0 = last
            if t0 < budget < timed[n]:  # linear between the last length in budget and this one
                chosen = int(n0 + (budget - t0) / (timed[n] - t0) * (n - n0))
            break
        chosen, last = n, (n, timed[n])
    what = f"{budget_steps:g} decode steps of {rows} row ({step_s * 1e3:.1f} ms each)"
    reason = (f"measured: a {chosen}-token prefill takes about {what}" if chosen else
              f"measured: even a {lengths[0]}-token prefill takes more than {what}")
    return Threshold(chosen, reason, step_s, timed)
