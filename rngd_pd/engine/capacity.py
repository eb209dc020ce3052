"""How many decode slots this instance holds when `num_slots` is 0: sized at load from the host.

A slot costs memory (one sequence's KV in every bucket) and time (each row it adds makes every step
longer, so every stream's time per output token). So the count is the smallest of

* by memory: the KV budget (`kv_cache_mb`, or a quarter of the memory free at load, as vLLM sizes
  its KV cache from a share of what the device has; on the CPU, free within the process's memory
  cgroup too, a pod's limit: rngd_pd.host.memory) over one slot's KV in every bucket;
* by step time: the most rows whose decode step takes at most `step_target_ms`: measured now at
  `PROBE_ROWS` rows, every row at `PROBE_POSITION` tokens, on the cores decode computes on while the
  host's other instances are idle (all of a decode host's; on a host it shares with prefill, steps
  taken while prefill computes are slower), and linear between them (a step reads the weights once
  and adds each row's attention; three probes keep the load under a second here);
* `MOST_SLOTS`: batch invariance is checked up to that many rows (rngd_pd.model.llama), and an
  explicit `num_slots` is the way past it.

Only runtimes that step any row count size themselves (cpu, cuda); a compiled one (RNGD, ATOM)
needs `num_slots` to name the widths its graphs are built for.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rngd_pd.config.dtypes import lookup
from rngd_pd.devices.kernels import cache_path, fastest, host_turn
from rngd_pd.devices.runtime import DeviceRuntime, plan_buckets
from rngd_pd.errors import ConfigError

MOST_SLOTS = 16
PROBE_ROWS = (1, 4, MOST_SLOTS)
PROBE_POSITION = 512  # a step's rows at this many tokens: the middle of the 128-1,536-token prompts served
KV_SHARE = 0.25  # of the memory free at load, when kv_cache_mb is 0
SIZED_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Capacity:
    """The slot count chosen, each limit, and the step times measured (rows -> ms)."""

    slots: int
    by_memory: int
    by_step: int
    reason: str
    step_ms: dict[int, float] = field(default_factory=dict)


def slot_bytes(runtime: DeviceRuntime, max_len: int, kv_dtype: Any) -> int:
    """One slot's KV in every bucket of `plan_buckets` (the engine gives each bucket every slot)."""
    c = runtime.loaded.config
    lengths = plan_buckets(1, max_len, None)
    return sum(lengths) * c.num_layers * 2 * c.num_kv_heads * c.head_dim * lookup(kv_dtype).itemsize


def time_steps(runtime: DeviceRuntime, rows: Sequence[int], kv_dtype: Any, position: int = PROBE_POSITION,
               repeat: int = 5) -> dict[int, float]:
    """Fastest ms of `repeat` decode steps of each row count (the other instances may be loading now:
    their work is not the step's), every row at `position`, on a scratch cache, on a thread of its own
    bound as the runtime's compute thread: the cores decode computes on while the host's other
    instances are idle (rngd_pd.devices.cores; its threads go with it, and the engine's scheduler
    binds itself when it starts)."""
    out: dict[int, float] = {}
    failed: list[BaseException] = []

    def run() -> None:
        try:
            runtime.compute_thread()
            out.update(_time_steps_here(runtime, rows, kv_dtype, position, repeat))
        except BaseException as exc:  # re-raised on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="decode-capacity")
    # decode and colocated load together: two timing at once measured 4-6 slots, one at a time 15-16
    with host_turn(cache_path().with_name("capacity.lock")):
        thread.start()
        thread.join()
    if failed:
        raise failed[0]
    return out


def _time_steps_here(runtime: DeviceRuntime, rows: Sequence[int], kv_dtype: Any, position: int,
                     repeat: int) -> dict[int, float]:
    most = max(rows)
    cache = runtime.new_cache(most, position + 1, kv_dtype)
    host, index = runtime.step_buffers(most)

    def step(n: int) -> None:
        host[0, :n], host[1, :n], host[2, :n] = 1, position, range(n)
        runtime.decode_step_parts(index[0, :n], index[1, :n], [(cache, index[2, :n])])

    with runtime.inference():  # the row counts take turns, so a busy moment costs each one sample
        best = fastest({n: functools.partial(step, n) for n in rows}, repeat)
    return {n: t * 1000 for n, t in best.items()}


def size_slots(runtime: DeviceRuntime, max_len: int, kv_dtype: Any, step_target_ms: float,
               kv_cache_mb: int = 0) -> Capacity:
    """The slot count for `num_slots` 0 (module docstring)."""
    kind = runtime.device.kind
    if kind not in SIZED_KINDS:
        raise ConfigError(f"num_slots 0 (sized at load) needs a runtime that steps any row count "
                          f"({', '.join(SIZED_KINDS)}); on {kind} set num_slots to the width its graphs are "
                          f"built for")
    budget = (kv_cache_mb << 20) if kv_cache_mb > 0 else int(runtime.memory().free * KV_SHARE)
    per_slot = slot_bytes(runtime, max_len, kv_dtype)
    by_memory = budget // per_slot
    if by_memory < 1:
        raise ConfigError(f"one decode slot needs {per_slot >> 20} MiB of KV ({max_len} tokens in every "
                          f"bucket) and the budget is {budget >> 20} MiB: lower max_len, raise kv_cache_mb "
                          f"or set num_slots")
    probes = sorted({min(n, by_memory) for n in PROBE_ROWS})
    step_ms = time_steps(runtime, probes, kv_dtype, position=min(PROBE_POSITION, max_len - 1))
    by_step = most_rows(step_ms, step_target_ms)
    slots = min(by_memory, by_step, MOST_SLOTS)
    step = (f"step time for {by_step} ({row_ms(step_ms, by_step):.0f} ms a step, target {step_target_ms:g})"
            if step_ms[min(step_ms)] <= step_target_ms else
            f"step time for 1 (even 1 row takes {step_ms[min(step_ms)]:.0f} ms, target {step_target_ms:g})")
    probed = ", ".join(f"{n}: {ms:.0f}" for n, ms in sorted(step_ms.items()))
    reason = (f"{slots} slots: KV memory for {by_memory} ({per_slot >> 20} MiB each, {budget >> 20} MiB "
              f"budget), {step}, at most {MOST_SLOTS} (ms a step by rows: {probed})")
    return Capacity(slots, by_memory, by_step, reason, step_ms)


def decode_slots(runtime: DeviceRuntime, num_slots: int, max_len: int, kv_dtype: Any,
                 step_target_ms: float, kv_cache_mb: int = 0) -> Capacity:
    """`num_slots` as given, or sized now when it is 0 (what decode and colocated call at load)."""
    if num_slots:
        return Capacity(num_slots, num_slots, num_slots, f"{num_slots} slots: set by num_slots")
    max_len = min(max_len, runtime.loaded.config.max_context)
    return size_slots(runtime, max_len, kv_dtype, step_target_ms, kv_cache_mb)


def row_ms(step_ms: dict[int, float], rows: int) -> float:
    """A step's ms at `rows`, linear between the measured row counts around it."""
    known = sorted(step_ms)
    lo = max((n for n in known if n <= rows), default=known[0])
    hi = min((n for n in known if n >= rows), default=known[-1])
    if hi == lo:
        return step_ms[lo]
    return step_ms[lo] + (step_ms[hi] - step_ms[lo]) * (rows - lo) / (hi - lo)


def most_rows(step_ms: dict[int, float], target_ms: float) -> int:
    """The most rows (up to the largest measured) whose step takes at most target_ms; 1 at least."""
    return max([n for n in range(1, max(step_ms) + 1) if row_ms(step_ms, n) <= target_ms], default=1)
