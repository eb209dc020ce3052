"""Loading a model instance onto its device: the device, torch's threads, the compute dtype and the
runtime the engines run through. Only prefill, decode and colocated load a model; the text models
(preprocess, postprocess) never import this module, so their stubs stay torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from rngd_pd.config.env import RNGD_PD_DTYPE
from rngd_pd.config.params import ServingParams, instance_index
from rngd_pd.config.settings import source_of
from rngd_pd.devices import select_device
from rngd_pd.devices.binding import runtime_for
from rngd_pd.devices.cpu_features import choose_compute_dtype
from rngd_pd.devices.rngd.artifacts import CompileOptions, parse_search
from rngd_pd.model.checkpoint import open_checkpoint
from rngd_pd.model.weights import LoadedModel, load_model, load_shared
from rngd_pd.stubs import pbutils


def check_device(params: ServingParams, args: Mapping[str, Any]) -> Any:
    """The device this instance runs on (rngd_pd.devices); DeviceUnavailableError names what is missing.

    NPU instances keep host tensors (the vendor adapters take them); the torch graphs run on cpu here.
    """
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
    device = check_device(params, args)
    rngd = CompileOptions(parse_search(params.rngd_search), params.rngd_artifacts)  # a bad value stops here
    if params.torch_threads > 0:
        torch.set_num_threads(params.torch_threads)
    source = dtype_source(params)
    config = open_checkpoint(params.model_path or None).config() if device.kind == "cpu" else None
    choice = choose_compute_dtype(params.dtype, device=device.kind, source=source, phase=phase, config=config)
    pbutils.log(f"{args.get('model_instance_name', '?')}: compute dtype {choice.dtype} ({choice.reason})",
                "warn" if choice.warning else "info")
    loaded = load_weights(params, args, choice.torch_dtype)
    try:
        runtime = runtime_for(device, loaded, rngd)
    except BaseException:
        loaded.close()
        raise
    if device.kind == "cpu" and params.share_cores:
        pbutils.log(f"{args.get('model_instance_name', '?')}: cores: {runtime.share_cores(phase)}")
    mem = runtime.memory()
    pbutils.log(f"{args.get('model_instance_name', '?')}: runtime {type(runtime).__name__} on {device.name} "
                f"({mem.free >> 20} of {mem.total >> 20} MiB free)")
    return runtime


def load_weights(params: ServingParams, args: Mapping[str, Any], dtype: torch.dtype) -> LoadedModel:
    """The weights: mapped from the host's weight store (the default), or read from the checkpoint
    (weight_store=false). The store's generation, fingerprint and build time go to the load log."""
    name = args.get("model_instance_name", "?")
    if not params.weight_store:
        return load_model(params.model_path or None, dtype=dtype, progress=False)
    t0 = time.monotonic()
    loaded = load_shared(params.model_path or None, dtype=dtype,
                         progress=lambda text: pbutils.log(f"{name}: {text}"))
    store = loaded.store
    assert store is not None
    pbutils.log(f"{name}: weights mapped from the weight store {store.path} (generation {store.generation}, "
                f"fingerprint {store.fingerprint}, {store.nbytes() >> 20} MiB) "
                f"in {time.monotonic() - t0:.1f} s")
    return loaded


def dtype_source(params: ServingParams) -> str:
    """Where the compute dtype came from, for the load log (recorded by parse_params, not re-read)."""
    source = source_of(params, "dtype")
    if source == f"${RNGD_PD_DTYPE.name}":
        return f"{source} (rngd-pd serve --dtype)"
    return source if source.startswith("$") else "the dtype parameter"
