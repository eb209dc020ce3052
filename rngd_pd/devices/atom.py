"""Rebellions ATOM: the decode graphs compiled by rebel-compiler and run by its runtime.

Written against rebel's public API (docs.rbln.ai, optimum-rbln; ../shared/research/npu-sdks.md); the
SDK is not installable here (it comes from Rebellions' own index), so what runs here is everything
around it: the static graph (`rngd_pd.model.static.StaticDecode`, checked against the eager model
on the CPU), one `input_info` list per bucket, the artifact cache keys, the error texts and the
import-time behaviour (rebel is imported only inside this module's functions). Compiling and
running happen on an ATOM host; `rngd-pd device-conformance atom` checks them there.

ATOM runs decode (its role in this system); prefill is refused with the configs that run it
elsewhere. The KV cache lives in host memory as the graphs' input, the step's new K/V rows are
outputs written back by the host: the original's path. Device-resident KV (one
`CompileContext(use_weight_sharing=True)` with every cache tensor `mark_static_address`ed, as
optimum-rbln does) is the measured next step, not done here.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rngd_pd.config.dtypes import DTYPES, KV_DTYPES, short_dtype, torch_dtype
from rngd_pd.config.env import RBLN_TARGET_SOC, RNGD_PD_ATOM_CACHE
from rngd_pd.devices.base import Device, unavailable
from rngd_pd.devices.runtime import GraphShapes, KVList, MemoryInfo, OnLayer, step_parts_in_turn
from rngd_pd.devices.torch_runtime import _host_memory
from rngd_pd.errors import ConfigError
from rngd_pd.model.cache import KVCache
from rngd_pd.model.static import StaticDecode

SDK = "rebel"
DEFAULT_CACHE = Path.home() / ".cache" / "rngd-pd" / "atom"
InputInfo = list[tuple[str, list[int], str]]  # rebel's (name, shape, dtype) per graph input


def import_rebel() -> Any:
    """The rebel module, or DeviceUnavailableError saying how to get it."""
    try:
        return importlib.import_module(SDK)
    except ImportError as exc:
        raise unavailable(f"the Rebellions SDK is not installed (import {SDK}: {exc})",
                          "install rebel-compiler from Rebellions' package index (a portal account) "
                          "with the RBLN driver") from None


def decode_input_info(config: Any, width: int, bucket: int, kv_dtype: str) -> InputInfo:
    """rebel's input_info for the decode graph of one (batch width, sequence bucket): the step's
    tokens and positions, then each layer's K and V cache [width, kv_heads, bucket, head_dim]."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    cache = [width, config.num_kv_heads, bucket, config.head_dim]
    info = [("tokens", [width], "int64"), ("positions", [width], "int64")]
    name = DTYPES[kv_dtype].torch_name
    for i in range(config.num_layers):
        info += [(f"k{i}", cache, name), (f"v{i}", cache, name)]
    return info


def bucket_input_infos(config: Any, shapes: GraphShapes) -> list[InputInfo]:
    """One input_info list per decode shape, in the order given: rebel compiles one graph per list
    into one model and its runtime picks the graph by the inputs' shapes."""
    kv = short_dtype(shapes.kv_dtype)
    return [decode_input_info(config, b, n, kv) for b, n in shapes.decode]


def cache_key(fingerprint: str, shapes: GraphShapes, npu: str, sdk_version: str) -> str:
    """The artifact's name: the same graph, shapes, dtypes, NPU and SDK give the same compiled file."""
    doc = {"model": fingerprint, "decode": sorted(shapes.decode), "dtype": short_dtype(shapes.dtype),
           "kv_dtype": short_dtype(shapes.kv_dtype), "npu": npu, "sdk": sdk_version,
           "graph": "static-decode-1"}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]


def target_npu(rebel: Any, index: int) -> str:
    """The NPU to compile for: the card's own name, else $RBLN_TARGET_SOC (card-less compiles)."""
    name = None
    with contextlib.suppress(Exception):
        name = rebel.get_npu_name(index)
    name = name or RBLN_TARGET_SOC.get()
    if not name:
        soc = RBLN_TARGET_SOC.name
        raise unavailable(f"no ATOM card answers at index {index} and ${soc} is not set",
                          f"check the driver (rbln-smi), or set {soc}=RBLN-CA25 to compile only")
    return name


class AtomRuntime:
    """Decode on one ATOM card (DeviceRuntime). Constructing it checks the SDK and the card."""

    def __init__(self, device: Device, loaded: Any) -> None:
        self.device, self.loaded = device, loaded
        self.rebel = import_rebel()
        if not self.rebel.npu_is_available(device.index):
            raise unavailable(f"ATOM card {device.index} is not available to rebel "
                              f"({self.rebel.device_count()} visible)", "check the driver and RBLN_DEVICES")
        self.npu = target_npu(self.rebel, device.index)
        self.cache_dir = RNGD_PD_ATOM_CACHE.get() or DEFAULT_CACHE
        self._runtime: Any = None
        self._shapes: GraphShapes | None = None

    def prepare(self, shapes: GraphShapes) -> None:
        """Compile (or load from the artifact cache) every decode bucket into one model with shared
        weights, and open a runtime on the card."""
        if not shapes.decode:
            return  # a prefill-only request of a decode device: nothing to build

        version = str(getattr(self.rebel, "__version__", "unknown"))
        path = self.cache_dir / f"decode-{cache_key(self.loaded.fingerprint, shapes, self.npu, version)}.rbln"
        if path.exists():
            compiled = self.rebel.RBLNCompiledModel(str(path))
        else:
            graph = StaticDecode(self.loaded.model, max_len=max(n for _, n in shapes.decode)).eval()
            ctx = self.rebel.compile_context.CompileContext(use_weight_sharing=True)
            compiled = self.rebel.compile_from_torch(graph, bucket_input_infos(self.loaded.config, shapes),
                                                     npu=self.npu, compile_context=ctx)
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save(str(path))
        self._runtime = self.rebel.Runtime(compiled, tensor_type="pt", device=self.device.index)
        self._shapes = shapes

    def dtype(self, name: Any) -> Any:
        return torch_dtype(name)

    def inference(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        return torch.inference_mode()

    def tokens(self, ids: Sequence[int] | Any) -> Any:
        raise self._no_prefill()

    def prefill(self, tokens: Any, past: KVList | None = None, on_layer: OnLayer | None = None,
                kv_dtype: Any = "bf16", all_logits: bool = False) -> tuple[Any, KVList]:
        raise self._no_prefill()

    def _no_prefill(self) -> Exception:
        return unavailable("the ATOM runtime runs decode only in this system",
                           "run prefill on rngd (config.pbtxt) or on cpu")

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        import torch

        return torch.empty(tuple(shape), dtype=self.dtype(dtype))  # host memory: the graph's input

    def new_cache(self, num_slots: int, max_len: int, kv_dtype: Any) -> Any:
        return KVCache(self.loaded.config, num_slots, max_len, self.dtype(kv_dtype))

    def step_buffers(self, rows: int) -> tuple[Any, Any]:
        import torch

        host = np.zeros((3, rows), dtype=np.int64)
        return host, torch.from_numpy(host)

    def decode_step(self, tokens: Any, positions: Any, cache: Any, slots: Any) -> Any:
        """Run the bucket's graph over the whole cache (its width is the graph's), write the new
        K/V rows back into the host cache, return the active rows' logits."""
        if self._runtime is None:
            raise ConfigError("AtomRuntime.prepare was not called for this cache's shape")
        import torch

        width = cache.num_slots
        b = int(tokens.shape[0])
        full_tokens = torch.zeros(width, dtype=torch.int64)
        full_pos = torch.zeros(width, dtype=torch.int64)
        full_tokens[slots], full_pos[slots] = tokens, positions
        caches = [t for kv in zip(cache.k, cache.v, strict=True) for t in kv]
        outs = self._runtime.run(full_tokens, full_pos, *caches)

        return StaticDecode.write_back(cache, tuple(outs), slots, positions).float()[:b]

    def decode_step_parts(self, tokens: Any, positions: Any, parts: Sequence[tuple[Any, Any]]) -> Any:
        return step_parts_in_turn(self, tokens, positions, parts)  # a graph per bucket shape

    def to_host(self, tensor: Any) -> Any:
        return tensor  # the cache and every graph output are host tensors on this path

    def to_device(self, tensor: Any) -> Any:
        return tensor

    def compute_thread(self) -> None:
        """Nothing is kept per thread."""

    def memory(self) -> MemoryInfo:
        return _host_memory()  # the KV is in host memory on this path; rbln-smi reports the card's
