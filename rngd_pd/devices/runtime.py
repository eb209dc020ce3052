"""The device interface: everything the engines ask of the accelerator a graph runs on.

The prefill and decode engines never import torch; they hold a `DeviceRuntime` bound to one loaded
model on one device and go through it for the two graphs (a prompt chunk's prefill, a batched decode
step), for buffers on the device (the KV cache) and for moving KV between host and device. A
runtime that cannot do what it is asked raises (`DeviceUnavailableError`, `ConfigError`); nothing
ever falls back to the CPU.

    runtime = runtime_for(select_device("cuda", 0), loaded)   # or as_runtime(loaded): torch on cpu
    runtime.prepare(GraphShapes(prefill_chunks=(512,), decode=((8, 2048),)))
    logits, kv = runtime.prefill(runtime.tokens(ids), kv_dtype="bf16")
    cache = runtime.new_cache(8, 2048, "bf16")
    logits = runtime.decode_step(tokens, positions, cache, slots)

Tensors crossing the interface: token ids, positions and slots are whatever `tokens()` /
`step_buffers()` gave; logits come back on the host in fp32 (samplers run there); a prefill's KV
comes back on the device (`to_host` copies it for a transport), `load` of a slot takes host or
device tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rngd_pd.devices.base import Device
from rngd_pd.errors import ConfigError

OnLayer = Callable[[int, Any, Any], None]
KVList = list[tuple[Any, Any]]


@dataclass(frozen=True)
class GraphShapes:
    """The shapes a device prepares graphs for (static-shape compilers compile one graph each).

    prefill_chunks: prompt lengths a prefill graph is built for (a longer prompt runs in chunks of
    the largest, a shorter one padded up to the next). decode: (batch width, sequence bucket) pairs.
    prefill_past: past lengths a chunk after earlier ones (or after a reused prefix) attends over,
    each a bucket a shorter past is padded up to (`past_buckets`). Dynamic-shape devices (torch)
    accept any shape and use these only to warm up.
    """

    prefill_chunks: tuple[int, ...] = (512,)
    decode: tuple[tuple[int, int], ...] = ()
    dtype: Any = "fp32"
    kv_dtype: Any = "bf16"  # a name or the runtime's own dtype
    prefill_past: tuple[int, ...] = ()

    def describe(self) -> str:
        widths = sorted({b for b, _ in self.decode})
        buckets = sorted({n for _, n in self.decode})
        past = f" after a past of up to {list(self.prefill_past)}" if self.prefill_past else ""
        return (f"prefill chunks {list(self.prefill_chunks)}{past}, decode widths {widths} x buckets "
                f"{buckets}, {self.dtype} compute, {self.kv_dtype} KV")


# What a device is checked and compiled for when nothing names its shapes: a chunk below the configured
# 512 and the chunk itself; decode one row, a partly filled width and a full one (device conformance,
# the RNGD compile check and its graphs' command line all start here).
DEFAULT_SHAPES = GraphShapes(prefill_chunks=(128, 512), decode=((1, 512), (4, 512), (8, 2048)), dtype="bf16")


def past_buckets(chunk: int, max_context: int) -> tuple[int, ...]:
    """The past lengths a static-shape prefill prepares for a prompt of up to max_context tokens in
    chunks of `chunk` (or after a reused prefix of any length): doubling from one chunk, the last
    one max_context; a past of P tokens runs in the smallest bucket >= P (about log2(max_context /
    chunk) + 1 graphs per chunk length)."""
    out, n = [], chunk
    while n < max_context:
        out.append(n)
        n *= 2
    return (*out, max_context)


DEFAULT_BUCKETS = (512, 2048, 8192)


def plan_buckets(
    num_slots: int, max_len: int, buckets: Sequence[int] | Mapping[int, int] | None
) -> dict[int, int]:
    """{bucket length: slots}. A sequence gives every bucket num_slots slots; max_len caps them."""
    if isinstance(buckets, Mapping):
        plan = {int(k): int(v) for k, v in buckets.items()}
    else:
        lengths = [b for b in (buckets or DEFAULT_BUCKETS) if b < max_len] + [max_len]
        plan = {int(b): num_slots for b in lengths}
    bad = {k: v for k, v in plan.items() if k < 2 or k > max_len or v < 1}
    if bad or not plan:
        raise ConfigError(f"buckets {plan} invalid: lengths must be in [2, {max_len}], slots >= 1")
    return dict(sorted(plan.items()))


def step_parts_in_turn(runtime: DeviceRuntime, tokens: Any, positions: Any,
                       parts: Sequence[tuple[Any, Any]]) -> Any:
    """`decode_step_parts` as one `decode_step` per part (graphs compiled per cache shape)."""
    import torch

    out, start = [], 0
    for cache, slots in parts:
        n = int(slots.shape[0])
        out.append(runtime.decode_step(tokens[start : start + n], positions[start : start + n], cache, slots))
        start += n
    return out[0] if len(out) == 1 else torch.cat(out)


def prefill_shapes(chunk_size: int | None, max_context: int, kv_dtype: Any = "bf16") -> GraphShapes:
    """The graphs a prefill engine prepares: its chunk (None or 0: whole prompts of up to
    max_context) and the past buckets of max_context. PrefillEngine and `rngd-pd compile` both
    plan with this."""
    chunk = chunk_size or max_context
    return GraphShapes(prefill_chunks=(chunk,), kv_dtype=kv_dtype,
                       prefill_past=past_buckets(chunk, max_context))


def decode_shapes(num_slots: int, max_len: int, kv_dtype: Any = "bf16",
                  buckets: Sequence[int] | Mapping[int, int] | None = None) -> GraphShapes:
    """The graphs a decode engine prepares: one (width, bucket) per bucket of `plan_buckets`, and
    GraphShapes' default prefill chunk (decode prefills short prompts itself: local prefill).
    DecodeEngine and `rngd-pd compile` both plan with this."""
    plan = plan_buckets(num_slots, max_len, buckets)
    return GraphShapes(decode=tuple((s, n) for n, s in plan.items()), kv_dtype=kv_dtype)


def cat_into(parts: Sequence[Any], dim: int, out: Any) -> None:
    """Concatenate host tensors along `dim` straight into `out` (one copy, no temporary): the prefix
    cache assembles a prompt's cached blocks with it, and the engines import no torch themselves."""
    import torch

    torch.cat(list(parts), dim=dim, out=out)


@dataclass(frozen=True)
class MemoryInfo:
    """What the device holds and has left, in bytes (host RAM for the CPU)."""

    total: int
    free: int
    detail: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class DeviceRuntime(Protocol):
    """One loaded model on one device. Thread-safety: `prefill` and `decode_step` may run on two
    threads at once (prefill and decode instances are separate processes, the colocated engine
    runs one of each); buffers are never shared between two calls in flight."""

    device: Device
    loaded: Any  # the LoadedModel: config, tokenizer, fingerprint

    def compute_thread(self) -> None:
        """The calling thread runs the graphs from now on (an engine's scheduler calls it once at
        its start); a runtime that keeps per-thread state binds it here, others do nothing."""
        ...

    def prepare(self, shapes: GraphShapes) -> None:
        """Build (compile, or load from the artifact cache) every graph `shapes` needs, now, so that
        no request pays for it; raises naming the shape and op a compiler refused."""
        ...

    def dtype(self, name: Any) -> Any:
        """The device's dtype for a name (bf16, fp16, fp32) or a dtype it already knows."""
        ...

    def inference(self) -> AbstractContextManager[Any]:
        """The context every graph call and KV copy runs in (no autograd bookkeeping)."""
        ...

    def tokens(self, ids: Sequence[int] | Any) -> Any:
        """Prompt token ids as the prefill graph's input (int64 [T])."""
        ...

    def prefill(self, tokens: Any, past: KVList | None = None, on_layer: OnLayer | None = None,
                kv_dtype: Any = "bf16", all_logits: bool = False) -> tuple[Any, KVList]:
        """Run T tokens after the P of `past`: host fp32 logits of the last token [vocab] (of every
        token, [T, vocab], with `all_logits`: a request's prompt logprobs; a runtime that cannot
        raises ConfigError) and the new per-layer (K, V) [kv_heads, T, head_dim] on the device;
        on_layer(i, K, V) gets layer i's as soon as it is computed (on the device: `to_host` before
        handing it to a transport)."""
        ...

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """An uninitialised buffer on the device (a chunked prefill assembles the prompt's KV in it)."""
        ...

    def new_cache(self, num_slots: int, max_len: int, kv_dtype: Any) -> Any:
        """A zeroed KVCache of num_slots sequences of max_len tokens, resident on the device."""
        ...

    def step_buffers(self, rows: int) -> tuple[Any, Any]:
        """(numpy int64 [3, rows], the same memory as the decode step's index input): the engine
        fills tokens / positions / slots in numpy, the step reads them without a copy."""
        ...

    def decode_step(self, tokens: Any, positions: Any, cache: Any, slots: Any) -> Any:
        """One token for each of B rows: writes their K/V into `cache`, host fp32 logits [B, vocab]."""
        ...

    def decode_step_parts(self, tokens: Any, positions: Any, parts: Sequence[tuple[Any, Any]]) -> Any:
        """`decode_step` over rows in several caches (the engine's buckets): parts[i] = (cache, slots)
        owns the next len(slots) rows. A runtime that can, reads the weights once for all rows (the
        step's cost then follows its rows, not its number of buckets); one whose graphs are per cache
        shape runs the parts in turn (`step_parts_in_turn`). Host fp32 logits [B, vocab]."""
        ...

    def to_host(self, tensor: Any) -> Any:
        """A host (CPU) tensor with the same bytes; the tensor itself when it already is one."""
        ...

    def to_device(self, tensor: Any) -> Any:
        """A device tensor with the same bytes."""
        ...

    def memory(self) -> MemoryInfo:
        """Bytes on the device: total and free (for the load log, `rngd-pd devices`, the EPP)."""
        ...
