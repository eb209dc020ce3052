"""What the repository's model.py files share: their parameter dataclasses, loading a model on the
configured device, and the decoupled-request skeleton (every request ends with exactly one final
response, also on error; `execute` never raises and never blocks on generation).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rngd_pd import errors
from rngd_pd.triton import pbutils
from rngd_pd.triton.params import (
    ENV_DECODE_URL,
    ENV_PREFILL_URL,
    ServingParams,
    describe,
    instance_index,
    param,
    parse_params,
)


@dataclass(frozen=True)
class PrefillParams(ServingParams):
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


@dataclass(frozen=True)
class ColocatedParams(ServingParams):
    num_slots: int = param(8, help="concurrent decode streams per instance")
    max_len: int = param(4096, help="longest prompt + max_tokens")
    chunk_size: int = param(512, help="prefill chunk (0 = whole prompt)")


@dataclass(frozen=True)
class PdParams:
    prefill_url: str | None = param(None, env=ENV_PREFILL_URL,
                                    help="gRPC host:port of a tritonserver with prefill (empty: BLS here)")
    decode_url: str | None = param(None, env=ENV_DECODE_URL,
                                   help="gRPC host:port of a tritonserver with decode (empty: BLS here)")
    prefill_model: str = param("prefill", help="name of the prefill model")
    decode_model: str = param("decode", help="name of the decode model")


@dataclass(frozen=True)
class TextParams:
    model_path: str | None = param(None, env="RNGD_PD_MODEL", help="checkpoint whose tokenizer to use")


def model_params(cls: type, args: Mapping[str, Any]) -> Any:
    """Parse this model's parameters from Triton's initialize args and log them."""
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


def load_for(params: ServingParams, args: Mapping[str, Any]) -> Any:
    """Check the device, set torch threads, load the checkpoint (embedded model when no path).

    bf16 compute by default: 2.5-4x faster than fp32 on CPUs with AVX512-BF16 (docs/model.md).
    """
    import torch

    from rngd_pd.model import load_model

    check_device(params, args)
    if params.torch_threads > 0:
        torch.set_num_threads(params.torch_threads)
    dtype = torch.bfloat16 if params.dtype == "bf16" else torch.float32
    return load_model(params.model_path or None, dtype=dtype, progress=False)


def run_decoupled(request: Any, work: Callable[[Any, Any], None], name: str) -> threading.Thread:
    """Run `work(request, sender)` on its own thread; an exception becomes the one final error response."""
    sender = request.get_response_sender()

    def target() -> None:
        try:
            work(request, sender)
        except BaseException as exc:  # every request ends with exactly one final response
            if not isinstance(exc, errors.RngdPdError | ValueError):
                pbutils.log(f"{name}: unexpected {exc!r}", "error")
            pbutils.send_error(sender, exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def getter(request: Any) -> Callable[[str], Any]:
    """`get(name)` -> numpy array or None for one Triton request (for rngd_pd.triton.inputs)."""
    return lambda name: pbutils.input_array(request, name)
