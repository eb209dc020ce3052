"""The torch device: the model's graphs run eagerly with torch on `cpu` or on `cuda:N`.

On `cuda` the weights, the KV cache and every step's inputs live on the GPU; logits come back to
the host for the samplers (B x vocab fp32 per step, ~3 MB at 16 rows) and a prefill's K/V is copied
to the host only where a transport needs it. On `cpu` nothing moves. Shapes are dynamic, so
`prepare` packs the decode weights and, on a GPU, runs each configured width once (warm-up).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rngd_pd.devices.base import Device, unavailable
from rngd_pd.devices.runtime import GraphShapes, KVList, MemoryInfo, OnLayer
from rngd_pd.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def torch_dtype(name: Any) -> torch.dtype:
    """torch dtype of a name (bf16, fp16, fp32) or a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


class TorchRuntime:
    """One LoadedModel on one torch device (see the module docstring)."""

    def __init__(self, device: Device, loaded: Any) -> None:
        if device.kind not in ("cpu", "cuda"):
            raise unavailable(f"the torch runtime cannot run on {device.kind!r}", "use cpu or cuda")
        self.device, self.loaded = device, loaded
        self.torch_device = torch.device(device.name if device.kind == "cuda" else "cpu")
        if device.kind == "cuda":
            if not torch.cuda.is_available():
                raise unavailable("torch sees no CUDA device", "install a CUDA build of torch and the driver")
            loaded.model.to(self.torch_device)  # weights on the GPU; nothing stays on the host
        on = loaded.model.embed.device
        if on.type != self.torch_device.type:
            raise ConfigError(f"the model's weights are on {on}, the runtime is on {self.torch_device}; "
                              "one model per device (load it again for another)")

    def prepare(self, shapes: GraphShapes) -> None:
        """For decode shapes: pack the decode weights (cpu; a prefill-only instance keeps no second
        copy), and on a GPU run each decode width once on a scratch cache, so CUDA's context and
        kernels are loaded before the first request."""
        if not shapes.decode:
            return
        self.loaded.model.prepare_decode()
        if self.device.kind != "cuda":
            return
        with self.inference():
            width = max(b for b, _ in shapes.decode)
            cache = self.new_cache(width, 16, shapes.kv_dtype)
            for b in sorted({b for b, _ in shapes.decode}):
                idx = torch.arange(b, device=self.torch_device)
                self.decode_step(torch.zeros_like(idx), torch.zeros_like(idx), cache, idx)

    def dtype(self, name: Any) -> torch.dtype:
        return torch_dtype(name)

    def inference(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()

    def tokens(self, ids: Sequence[int] | Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.torch_device)

    def prefill(self, tokens: torch.Tensor, past: KVList | None = None, on_layer: OnLayer | None = None,
                kv_dtype: Any = "bf16") -> tuple[torch.Tensor, KVList]:
        logits, kv = self.loaded.model.prefill(tokens, past=past, on_layer=on_layer,
                                               kv_dtype=torch_dtype(kv_dtype))
        return self.to_host(logits).float(), kv

    def empty(self, shape: Sequence[int], dtype: Any) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.torch_device)

    def new_cache(self, num_slots: int, max_len: int, kv_dtype: Any) -> Any:
        from rngd_pd.model.cache import KVCache

        dtype = torch_dtype(kv_dtype)
        return KVCache(self.loaded.config, num_slots, max_len, dtype, device=self.torch_device)

    def step_buffers(self, rows: int) -> tuple[np.ndarray, torch.Tensor]:
        host = np.zeros((3, rows), dtype=np.int64)
        tensor = torch.from_numpy(host)
        if self.device.kind == "cuda":  # a pinned copy is sent each step (3 x rows int64)
            return host, _Uploaded(tensor, self.torch_device)
        return host, tensor

    def decode_step(self, tokens: Any, positions: Any, cache: Any, slots: Any) -> torch.Tensor:
        logits = self.loaded.model.decode_step(tokens, positions, cache, slots)
        return logits if logits.device.type == "cpu" else logits.float().cpu()

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device.type == "cpu" else tensor.cpu()

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.torch_device)

    def memory(self) -> MemoryInfo:
        if self.device.kind == "cuda":
            free, total = torch.cuda.mem_get_info(self.torch_device)
            return MemoryInfo(total, free, {"allocated": torch.cuda.memory_allocated(self.torch_device)})
        return _host_memory()


class _Uploaded:
    """The decode step's index buffer on a GPU: sliced like the host tensor, copied up on use."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device = host, device

    def __getitem__(self, item: Any) -> torch.Tensor:
        return self.host[item].to(self.device, non_blocking=False)


def _host_memory() -> MemoryInfo:
    """MemTotal / MemAvailable of this host (cgroup limits are the orchestrator's business)."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    total = fields.get("MemTotal", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return MemoryInfo(total, fields.get("MemAvailable", 0))
