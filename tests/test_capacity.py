"""Decode slots sized at load (rngd_pd.engine.capacity): by the KV memory the buckets really allocate,
by decode steps timed on the real CPU runtime, and the errors that name the fix."""

from __future__ import annotations

import types

import pytest
import torch

from rngd_pd.devices.runtime import plan_buckets
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine import capacity
from rngd_pd.errors import ConfigError
from rngd_pd.model import KVCache


def test_a_slot_costs_what_its_caches_allocate_in_every_bucket(smollm) -> None:
    runtime = as_runtime(smollm)
    for max_len, kv in ((4096, "bf16"), (2048, "fp32"), (300, "bf16")):
        lengths = plan_buckets(1, max_len, None)
        allocated = sum(KVCache(smollm.config, 1, n, runtime.dtype(kv)).nbytes for n in lengths)
        assert capacity.slot_bytes(runtime, max_len, kv) == allocated


def test_rows_between_probes_are_linear() -> None:
    ms = {1: 40.0, 4: 55.0, 16: 100.0}
    assert capacity.row_ms(ms, 10) == pytest.approx(77.5)
    assert capacity.most_rows(ms, 100.0) == 16
    assert capacity.most_rows(ms, 70.0) == 8  # 55 + 45 * 4 / 12 = 70
    assert capacity.most_rows(ms, 39.0) == 1  # never below one slot
    assert capacity.most_rows({1: 10.0, 2: 30.0}, 1000.0) == 2  # not past the largest measured


def test_sizing_takes_the_smaller_of_memory_and_step_time(smollm) -> None:
    runtime = as_runtime(smollm)
    per_slot = capacity.slot_bytes(runtime, 512, "bf16")
    three = -(-3 * per_slot // (1 << 20))  # MiB for three slots
    got = capacity.size_slots(runtime, 512, "bf16", step_target_ms=1e9, kv_cache_mb=three)
    assert (got.slots, got.by_memory) == (3, 3)
    assert sorted(got.step_ms) == [1, 3] and all(ms > 0 for ms in got.step_ms.values())  # probes capped
    assert got.reason.startswith("3 slots: KV memory for 3")

    free = capacity.size_slots(runtime, 512, "bf16", step_target_ms=1e9, kv_cache_mb=1 << 20)
    assert free.slots == capacity.MOST_SLOTS and sorted(free.step_ms) == list(capacity.PROBE_ROWS)

    slow = capacity.size_slots(runtime, 512, "bf16", step_target_ms=1e-3, kv_cache_mb=1 << 20)
    assert (slow.slots, slow.by_step) == (1, 1) and "even 1 row takes" in slow.reason
    assert torch.get_num_threads() >= 1


def test_sizing_errors_name_the_fix(smollm) -> None:
    runtime = as_runtime(smollm)
    with pytest.raises(ConfigError, match="raise kv_cache_mb or set num_slots"):
        capacity.size_slots(runtime, 4096, "bf16", step_target_ms=100.0, kv_cache_mb=1)
    compiled = types.SimpleNamespace(device=types.SimpleNamespace(kind="atom"))
    with pytest.raises(ConfigError, match="on atom set num_slots"):
        capacity.size_slots(compiled, 4096, "bf16", step_target_ms=100.0)


def test_a_set_count_is_kept_and_zero_is_sized_within_the_models_context(smollm) -> None:
    runtime = as_runtime(smollm)
    kept = capacity.decode_slots(runtime, 5, 4096, "bf16", step_target_ms=100.0)
    assert (kept.slots, kept.reason) == (5, "5 slots: set by num_slots")
    longest = smollm.config.max_context
    sized = capacity.decode_slots(runtime, 0, longest * 4, "bf16", step_target_ms=1e9, kv_cache_mb=1 << 20)
    per_slot = capacity.slot_bytes(runtime, longest, "bf16")
    assert sized.slots == capacity.MOST_SLOTS and f"({per_slot >> 20} MiB each" in sized.reason
