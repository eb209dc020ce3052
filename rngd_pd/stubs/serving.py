"""What the repository's model.py files share: their parameter dataclasses, loading a model on the
configured device, and reading a request's inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rngd_pd.config.env import (
    RNGD_PD_DECODE_URL,
    RNGD_PD_DECODE_VIA,
    RNGD_PD_DTYPE,
    RNGD_PD_MODEL,
    RNGD_PD_PREFILL_URL,
)
from rngd_pd.config.params import (
    ServingParams,
    describe,
    instance_index,
    param,
    parse_params,
    source_of,
)
from rngd_pd.kv import Transport, load_transport
from rngd_pd.stubs import pbutils


@dataclass(frozen=True)
class PrefixParams:
    """Prefix reuse (rngd_pd.engine.prefix), in every model that prefills."""

    prefix_cache_mb: int = param(512, help="host memory for reused prompt prefixes' KV (0 = no reuse)")
    prefix_block: int = param(32, help="tokens per prefix cache block (prefixes are reused in whole blocks)")

    def prefix_kwargs(self) -> dict[str, int]:
        return {"prefix_cache_bytes": max(0, self.prefix_cache_mb) << 20, "prefix_block": self.prefix_block}


@dataclass(frozen=True)
class PrefillParams(PrefixParams, ServingParams):
    chunk_size: int = param(512, help="prefill long prompts in chunks of this many tokens (0 = whole)")
    max_len: int = param(4096, help="longest prompt + max_tokens accepted")


@dataclass(frozen=True)
class DecodeParams(ServingParams):
    num_slots: int = param(8, help="concurrent decode streams per instance (continuous batching)")
    max_len: int = param(4096, help="longest prompt + max_tokens one slot holds")
    max_queue: int = param(64, help="requests waiting for a slot before CapacityError")
    # It includes the time the request waits in prefill's queue, so it is generous; a prefill that fails
    # makes pd cancel the decode request, which ends the wait at once.
    kv_timeout_s: float = param(300.0, help="how long decode waits for a request's KV")
    local_prefill_tokens: int = param(-1, help="prompts up to this long are prefilled by decode itself, "
                                               "no hand-off (-1 = measured at load, 0 = never)")


@dataclass(frozen=True)
class ColocatedParams(PrefixParams, ServingParams):
    num_slots: int = param(8, help="concurrent decode streams per instance")
    max_len: int = param(4096, help="longest prompt + max_tokens")
    chunk_size: int = param(512, help="prefill chunk (0 = whole prompt)")
    max_inflight: int = param(32, help="requests run at once (one worker thread each, a fixed pool)")
    max_queue: int = param(64, help="requests waiting for a worker before CapacityError")


@dataclass(frozen=True)
class PdParams:
    prefill_url: str | None = param(env=RNGD_PD_PREFILL_URL,
                                    help="gRPC host:port of a tritonserver with prefill (empty: BLS here)")
    decode_url: str | None = param(env=RNGD_PD_DECODE_URL,
                                   help="gRPC host:port of a tritonserver with decode (empty: this one)")
    decode_via: str = param(env=RNGD_PD_DECODE_VIA, choices=("grpc", "bls"),
                            help="how pd reaches a decode in this server: its own gRPC endpoint, or BLS "
                                 "(which can deadlock Triton 2.51's stub under load: docs/serving.md)")
    prefill_model: str = param("prefill", help="name of the prefill model")
    decode_model: str = param("decode", help="name of the decode model")
    # Each running request holds up to two of the Python backend's pool threads (its prefill and its
    # decode BLS call wait on them), so `rngd-pd serve` sizes thread-pool-size from this.
    max_inflight: int = param(32, help="requests orchestrated at once (fixed pools of workers)")
    max_queue: int = param(64, help="requests waiting for a worker before CapacityError")
    local_prefill_tokens: int = param(-1, help="prompts up to this long are prefilled by decode itself "
                                               "(-1 = the length decode measured, 0 = always hand off)")
    local_prefill_when: str = param("busy", choices=("busy", "always"),
                                    help="busy: prefill a short prompt on decode when fewer prompt tokens "
                                         "wait there than for prefill; always: by length alone")


@dataclass(frozen=True)
class TextParams:
    model_path: str | None = param(env=RNGD_PD_MODEL, help="checkpoint whose tokenizer to use")


def model_params(cls: type, args: Mapping[str, Any]) -> Any:
    """Parse this model's parameters from Triton's initialize args and log them. Every model's
    `initialize` starts here, so this is also where the stub learns to exit with its tritonserver."""
    from rngd_pd.host.children import exit_when_orphaned

    exit_when_orphaned()
    params = parse_params(cls, args["model_config"])
    pbutils.log(f"{args.get('model_name', '?')} ({args.get('model_instance_name', '?')}): {describe(params)}")
    return params


def check_device(params: ServingParams, args: Mapping[str, Any]) -> Any:
    """The device this instance runs on (rngd_pd.devices); DeviceUnavailableError names what is missing.

    NPU instances keep host tensors (the vendor adapters take them); the torch graphs run on cpu here.
    """
    from rngd_pd.devices import select_device

    instance = instance_index(args.get("model_instance_name", ""))
    device = select_device(params.device, params.device_id_for(instance), instance=instance)
    pbutils.log(f"{args.get('model_instance_name', '?')}: device {device.name} ({device.detail})")
    return device


def load_for(params: ServingParams, args: Mapping[str, Any], phase: str = "both") -> Any:
    """Check the device, set torch threads, load the checkpoint (embedded model when no path) and
    bind it to the device's runtime (rngd_pd.devices.runtime): the engines run only through it.

    Compute dtype `auto` (the default): on a CPU, the faster of bf16 and fp32 for this model's
    `phase` (prefill, decode, or both for colocated), measured on this host and cached
    (rngd_pd.devices.kernels); bf16 wins where the CPU has native bf16 (AVX512-BF16, AMX, Arm BF16)
    and loses ~8x on AVX2 alone. bf16/fp32 force one. The choice and why go to the load log.
    """
    import torch

    from rngd_pd.devices.cpu_features import choose_compute_dtype
    from rngd_pd.model import load_model

    device = check_device(params, args)
    if params.torch_threads > 0:
        torch.set_num_threads(params.torch_threads)
    source = dtype_source(params)
    from rngd_pd.model.checkpoint import open_checkpoint

    config = open_checkpoint(params.model_path or None).config() if device.kind == "cpu" else None
    choice = choose_compute_dtype(params.dtype, device=device.kind, source=source, phase=phase, config=config)
    pbutils.log(f"{args.get('model_instance_name', '?')}: compute dtype {choice.dtype} ({choice.reason})",
                "warn" if choice.warning else "info")
    from rngd_pd.devices.runtime import runtime_for

    loaded = load_model(params.model_path or None, dtype=choice.torch_dtype, progress=False)
    runtime = runtime_for(device, loaded)
    if device.kind == "cpu" and params.share_cores:
        pbutils.log(f"{args.get('model_instance_name', '?')}: cores: {runtime.share_cores(phase)}")
    mem = runtime.memory()
    pbutils.log(f"{args.get('model_instance_name', '?')}: runtime {type(runtime).__name__} on {device.name} "
                f"({mem.free >> 20} of {mem.total >> 20} MiB free)")
    return runtime


def dtype_source(params: ServingParams) -> str:
    """Where the compute dtype came from, for the load log (recorded by parse_params, not re-read)."""
    source = source_of(params, "dtype")
    if source == f"${RNGD_PD_DTYPE.name}":
        return f"{source} (rngd-pd serve --dtype)"
    return source if source.startswith("$") else "the dtype parameter"


def getter(request: Any) -> Callable[[str], Any]:
    """`get(name)` -> numpy array or None for one Triton request (for rngd_pd.wire.inputs)."""
    return lambda name: pbutils.input_array(request, name)


def transport_for(params: ServingParams) -> Transport:
    """The configured KV transport, built with its options (a bad option fails the model's load)."""
    options = {"config": params.kv_options} if params.kv_options else {}
    return load_transport(params.kv_transport, **options)
