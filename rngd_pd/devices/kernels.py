"""The compute dtype each phase runs fastest in on this CPU, measured with the model's own kernels.

CPU flags say where bf16 is native (rngd_pd.devices.cpu_features), but not what torch's kernels make
of it on a given CPU, thread count and model shape. So `auto` on a CPU times the model's two phases
in each dtype the model serves in (bf16 and fp32: weights and compute in the same dtype) on a
two-layer copy of the model with random weights: the same widths and heads, the vocabulary cut by the
same factor as the layers, so the LM head weighs in the probe what it weighs in the whole model. The
candidates run interleaved and each keeps its fastest run (a shared, noisy host slows runs down, it
never speeds one up). The faster one is taken:

* prefill: one 256-token prompt (`Llama.prefill`, the prefill model's work);
* decode: one batched step of 8 rows at 256 cached positions (`Llama.decode_step`, packed weights);
* both (the colocated model, one dtype for the two): a 256-token prefill plus 64 decode steps.

A measurement takes about a second and is cached per CPU, torch version, thread count and model shape
in `<cache>/kernels.json` (RNGD_PD_CACHE, else ~/.cache/rngd-pd), so later loads only read it. bf16
weights with fp32 compute are not a candidate: torch's CPU GEMMs take one dtype for both operands, so
the weights would be converted at every step (more memory traffic than fp32 weights, not less).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rngd_pd.config.dtypes import COMPUTE_DTYPES, torch_dtype
from rngd_pd.config.settings import cache_root
from rngd_pd.errors import ConfigError
from rngd_pd.model.cache import KVCache
from rngd_pd.model.llama import Llama

PHASES = ("prefill", "decode", "both")
PREFILL_TOKENS = 256
DECODE_ROWS = 8
DECODE_CONTEXT = 256
DECODE_STEPS_PER_PROMPT = 64  # `both`: one prefill + this many decode steps
PROBE_LAYERS = 2
CACHE_FILE = "kernels.json"
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class PhaseTimes:
    """Seconds of one prefill and one decode step per candidate dtype on the probe model."""

    prefill_s: dict[str, float]
    decode_s: dict[str, float]

    def cost(self, phase: str, dtype: str) -> float:
        if phase == "prefill":
            return self.prefill_s[dtype]
        if phase == "decode":
            return self.decode_s[dtype]
        return self.prefill_s[dtype] + DECODE_STEPS_PER_PROMPT * self.decode_s[dtype]

    def best(self, phase: str) -> str:
        return min(COMPUTE_DTYPES, key=lambda d: self.cost(phase, d))

    def describe(self, phase: str) -> str:
        """`bf16 3.1 ms vs fp32 9.8 ms per decode step (3.2x)`, for the load log."""
        what = {"prefill": f"per {PREFILL_TOKENS}-token prefill",
                "decode": f"per {DECODE_ROWS}-row decode step",
                "both": f"per {PREFILL_TOKENS}-token prefill + {DECODE_STEPS_PER_PROMPT} decode steps"}[phase]
        best = self.best(phase)
        other = next(d for d in COMPUTE_DTYPES if d != best)
        a, b = self.cost(phase, best), self.cost(phase, other)
        return (f"{best} {a * 1e3:.1f} ms vs {other} {b * 1e3:.1f} ms {what} of a {PROBE_LAYERS}-layer probe "
                f"({b / a:.1f}x)")


def cache_path(env: Mapping[str, str] | None = None) -> Path:
    return cache_root(env) / CACHE_FILE


def cache_key(config: Any, cpu: Any, threads: int, torch_version: str) -> str:
    """What a measurement depends on: the CPU (model name and flags), torch, threads, the shapes."""
    shape = (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_heads,
             config.num_kv_heads, config.head_dim, config.tie_word_embeddings)
    flags = hashlib.blake2b(" ".join(sorted(cpu.flags)).encode(), digest_size=6).hexdigest()
    return f"{cpu.model or cpu.arch}|flags {flags}|torch {torch_version}|threads {threads}|shape {shape}"


def _probe(config: Any, dtype: Any) -> Any:
    import torch

    layers = min(PROBE_LAYERS, config.num_layers)
    vocab = max(256, config.vocab_size * layers // config.num_layers)
    small = dataclasses.replace(config, num_layers=layers, vocab_size=vocab,
                                max_context=max(PREFILL_TOKENS, DECODE_CONTEXT) + 16)
    model = Llama(small, dtype)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def fastest(runs: dict[Any, Any], repeat: int) -> dict[Any, float]:
    """Each callable's fastest of `repeat` runs, the candidates interleaved, after one warm-up each."""
    best = {}
    for name, run in runs.items():
        run()  # first-call allocations, oneDNN primitive creation
        best[name] = float("inf")
    for _ in range(repeat):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def measure(config: Any, repeat: int = 5) -> PhaseTimes:
    """Time the probe model's prefill and decode step in each candidate dtype (current torch threads)."""
    import torch

    prefills, steps = {}, {}
    for name in COMPUTE_DTYPES:
        dtype = torch_dtype(name)
        model = _probe(config, dtype)
        model.prepare_decode()
        tokens = torch.arange(PREFILL_TOKENS) % model.config.vocab_size
        cache = KVCache(model.config, DECODE_ROWS, DECODE_CONTEXT + 8, dtype)
        rows = torch.arange(DECODE_ROWS)
        positions = torch.full((DECODE_ROWS,), DECODE_CONTEXT)
        prefills[name] = functools.partial(model.prefill, tokens, kv_dtype=dtype)
        steps[name] = functools.partial(model.decode_step, rows + 1, positions, cache, rows)
    with torch.inference_mode():
        prefill_s = fastest(prefills, repeat)
        decode_s = fastest(steps, repeat * 3)
    return PhaseTimes(prefill_s, decode_s)


def measured(config: Any, cpu: Any, env: Mapping[str, str] | None = None) -> tuple[PhaseTimes, bool]:
    """(times, whether they came from the cache) for this host and model shape; measures on a miss."""
    import torch

    key = cache_key(config, cpu, torch.get_num_threads(), torch.__version__)
    path = cache_path(env)
    with _lock, host_turn(path.with_suffix(".lock")):  # prefill and decode load at once: one measures
        return _measured_locked(config, key, path)


@contextlib.contextmanager
def host_turn(lock: Path) -> Iterator[None]:
    """The block runs in one process of this host at a time (flock on `lock`, made if missing): the
    instances' load-time measurements take turns. Without the file (no cache directory) no turns."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(lock, "a")  # noqa: SIM115 - held for the block below
    except OSError:
        yield
        return
    with lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def _measured_locked(config: Any, key: str, path: Path) -> tuple[PhaseTimes, bool]:
    table = _read(path)
    entry = table.get(key)
    if isinstance(entry, dict) and {"prefill_s", "decode_s"} <= entry.keys():
        return PhaseTimes(entry["prefill_s"], entry["decode_s"]), True
    times = measure(config)
    table[key] = dataclasses.asdict(times)
    try:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: a reader never sees half a file
    except OSError:
        pass  # a read-only cache: measured again next time
    return times, False


def _read(path: Path) -> dict[str, Any]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def check_phase(phase: str) -> str:
    if phase not in PHASES:
        raise ConfigError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
    return phase
