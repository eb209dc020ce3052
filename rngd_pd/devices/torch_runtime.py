"""The torch device: the model's graphs run eagerly with torch on `cpu` or on `cuda:N`.

On `cuda` the weights, the KV cache and every step's inputs live on the GPU; logits come back to
the host for the samplers (B x vocab fp32 per step, ~3 MB at 16 rows) and a prefill's K/V is copied
to the host only where a transport needs it. On `cpu` nothing moves. Shapes are dynamic, so
`prepare` packs the decode weights and, on a GPU, runs each configured width once (warm-up).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rngd_pd.config.dtypes import torch_dtype
from rngd_pd.devices.base import Device, unavailable
from rngd_pd.devices.cores import CoreShare, host_cores
from rngd_pd.devices.runtime import DeviceRuntime, GraphShapes, KVList, MemoryInfo, OnLayer
from rngd_pd.errors import ConfigError
from rngd_pd.host.memory import process_memory
from rngd_pd.model.cache import KVCache
from rngd_pd.model.llama import StepPart

log = logging.getLogger(__name__)

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
        self.cores: CoreShare | None = None  # share_cores: idle cores lent between instances (cpu)

    def share_cores(self, phase: str) -> str:
        """Join the host's core board (rngd_pd.devices.cores) with this thread's torch threads as the
        share; lend idle cores only where a step and a prefill give the same bits at the share and at
        every core (checked now, ~1 s). Returns what was decided, for the load log."""
        if self.device.kind != "cpu":
            return "not on a CPU: no cores to lend"
        share, cores = torch.get_num_threads(), host_cores()
        differs = _same_bits_on_a_thread(self, share, cores, phase) if share < cores else ""
        lend = share < cores and not differs
        omp = _OpenMP()
        omp.release_team()  # a team this thread made before torch_threads applied would slow the lender
        self.cores = CoreShare(share, omp.set_threads, cores=cores, lend=lend, get_threads=omp.get_threads)
        if not self.cores.enabled:
            return f"{share} threads always (no core board, see the log line before)"
        if lend:
            return f"{share} threads, up to {cores} while the other instances on this host are idle"
        return f"{share} threads always: " + (differs or f"{share} of {cores} cores is all there is")

    def compute_thread(self) -> None:
        """The calling thread runs this runtime's graphs from now on: on a CPU with `share_cores`,
        the one that may compute on lent cores (rngd_pd.devices.cores)."""
        if self.cores is not None:
            torch.get_num_threads()  # torch's own per-thread set-up first, so it cannot undo a lent count
            self.cores.bind()

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

    def prepare_weights(self, loaded: Any) -> None:
        """Derive this instance's own state for `loaded` (another generation of the same model, to
        switch to later by assigning `self.loaded`): its copy on the GPU, and the packed decode
        weights if this instance packed its current ones. Serving goes on meanwhile."""
        if self.device.kind == "cuda":
            loaded.model.to(self.torch_device)
        loaded.model.pack = self.loaded.model.pack
        if self.loaded.model._packing_done:
            loaded.model.prepare_decode()

    def dtype(self, name: Any) -> torch.dtype:
        return torch_dtype(name)

    def inference(self) -> contextlib.AbstractContextManager[Any]:
        return torch.inference_mode()

    def tokens(self, ids: Sequence[int] | Any) -> torch.Tensor:
        return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.torch_device)

    def prefill(self, tokens: torch.Tensor, past: KVList | None = None, on_layer: OnLayer | None = None,
                kv_dtype: Any = "bf16", all_logits: bool = False) -> tuple[torch.Tensor, KVList]:
        cores = self.cores
        if cores is None:
            logits, kv = self.loaded.model.prefill(tokens, past=past, on_layer=on_layer,
                                                   kv_dtype=torch_dtype(kv_dtype), all_logits=all_logits)
            return self.to_host(logits).float(), kv

        def layer_done(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            if on_layer is not None:
                on_layer(i, k, v)
            cores.fit()  # the next layer runs on what is idle now

        with cores.working():
            logits, kv = self.loaded.model.prefill(tokens, past=past, on_layer=layer_done,
                                                   kv_dtype=torch_dtype(kv_dtype), all_logits=all_logits)
        return self.to_host(logits).float(), kv

    def empty(self, shape: Sequence[int], dtype: Any) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.torch_device)

    def new_cache(self, num_slots: int, max_len: int, kv_dtype: Any) -> Any:
        dtype = torch_dtype(kv_dtype)
        return KVCache(self.loaded.config, num_slots, max_len, dtype, device=self.torch_device)

    def step_buffers(self, rows: int) -> tuple[np.ndarray, torch.Tensor]:
        host = np.zeros((3, rows), dtype=np.int64)
        tensor = torch.from_numpy(host)
        if self.device.kind == "cuda":  # a pinned copy is sent each step (3 x rows int64)
            return host, _Uploaded(tensor, self.torch_device)
        return host, tensor

    def decode_step(self, tokens: Any, positions: Any, cache: Any, slots: Any) -> torch.Tensor:
        return self.decode_step_parts(tokens, positions, [(cache, slots)])

    def decode_step_parts(self, tokens: Any, positions: Any, parts: Sequence[StepPart]) -> torch.Tensor:
        with self.cores.working() if self.cores is not None else contextlib.nullcontext():
            logits = self.loaded.model.decode_step_parts(tokens, positions, list(parts))
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


class _OpenMP:
    """The calling thread's OpenMP thread count, and nothing else: torch.set_num_threads also sets
    the process-wide count that every other thread takes at its first parallel op (the KV loaders, a
    local prefill), which would give them teams of their own (rngd_pd.devices.cores). MKL, which runs
    torch's fp32 GEMMs where oneDNN does not (prefill's projections in fp32), keeps a count of its own,
    which torch.set_num_threads set on the execute thread at load: without MKL's thread-local count set
    too, a prefill lent both cores of a 2-core AVX2 host ran its GEMMs on one. A torch built without
    libgomp falls back to torch's own setter."""

    def __init__(self) -> None:
        lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
        gomp = os.path.join(lib_dir, "libgomp.so.1")
        try:
            lib = ctypes.CDLL(gomp if os.path.exists(gomp) else None)
            self._set, self._get = lib.omp_set_num_threads, lib.omp_get_max_threads
            self._pause = getattr(lib, "omp_pause_resource_all", None)
        except (OSError, AttributeError):
            self._set = self._get = self._pause = None
            return
        self._set.argtypes, self._set.restype, self._get.restype = [ctypes.c_int], None, ctypes.c_int
        self._mkl = _mkl_local_setter(os.path.join(lib_dir, "libtorch_cpu.so"))

    def set_threads(self, n: int) -> None:
        if self._set is None:
            torch.set_num_threads(n)
        else:
            self._set(n)
            if self._mkl is not None:
                self._mkl(n)

    def get_threads(self) -> int:
        return int(self._get()) if self._get is not None else torch.get_num_threads()

    def release_team(self) -> None:
        """Let the calling thread's idle OpenMP workers go (omp_pause_hard); it gets new ones on
        its next parallel region with more than one thread."""
        if self._pause is not None:
            self._pause(2)


def _mkl_local_setter(lib: str) -> Callable[[int], int] | None:
    """MKL's C `MKL_Set_Num_Threads_Local(int)` (the calling thread's count; 0 = the global one)
    where torch links MKL in, else None. Not `mkl_set_num_threads_local`: in this build that name is
    the Fortran entry, which takes a pointer."""
    try:
        fn = ctypes.CDLL(lib).MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def _same_bits_on_a_thread(runtime: TorchRuntime, share: int, cores: int, phase: str) -> str:
    """_same_bits_at on a thread of its own: its OpenMP team goes with it (rngd_pd.devices.cores)."""
    result: list[str] = ["the check did not finish"]

    def check() -> None:
        torch.set_num_threads(share)
        result[0] = _same_bits_at(runtime, share, cores, phase)

    thread = threading.Thread(target=check, name="rngd-pd-cores-check")
    thread.start()
    thread.join()
    return result[0]


def _same_bits_at(runtime: TorchRuntime, share: int, cores: int, phase: str) -> str:
    """"" when a decode step (rows 1..16, the widths where CPU GEMMs change code paths) and a
    prefill give the same bits at `share` and at `cores` threads on this host; else what differed.
    Runs on the calling thread and leaves its thread count at `share`."""
    model, c = runtime.loaded.model, runtime.loaded.config
    gen = torch.Generator().manual_seed(0)
    runs: list[Callable[[], torch.Tensor]] = []
    if phase in ("decode", "both"):
        model.prepare_decode()
        cache = KVCache(c, 16, 64, torch.bfloat16)
        for t in cache.k + cache.v:
            t.copy_(torch.randn(t.shape, generator=gen))
        for b in (1, 2, 3, 5, 7, 8, 11, 16):
            toks = torch.randint(0, c.vocab_size, (b,), generator=gen)
            pos = torch.randint(0, 63, (b,), generator=gen)
            runs.append(lambda toks=toks, pos=pos, b=b: model.decode_step(toks, pos, cache, torch.arange(b)))
    if phase in ("prefill", "both"):
        ids = torch.randint(0, c.vocab_size, (96,), generator=gen)
        runs.append(lambda: model.prefill(ids)[0])
    try:
        with torch.inference_mode():
            for i, run in enumerate(runs):
                torch.set_num_threads(share)
                a = run()
                torch.set_num_threads(cores)
                if not torch.equal(a, run()):
                    what = "a prefill" if phase != "decode" and i == len(runs) - 1 else "a decode step"
                    return f"{what} gives other bits at {cores} threads than at {share}"
    finally:
        torch.set_num_threads(share)
    return ""


class _Uploaded:
    """The decode step's index buffer on a GPU: sliced like the host tensor, copied up on use."""

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host, self.device = host, device

    def __getitem__(self, item: Any) -> torch.Tensor:
        return self.host[item].to(self.device, non_blocking=False)


def _host_memory() -> MemoryInfo:
    """The host's memory as this process may use it: capped by its memory cgroup (a pod's limit)."""
    mem = process_memory()
    return MemoryInfo(mem.total, mem.free)


def as_runtime(obj: Any) -> DeviceRuntime:
    """A runtime as is; a LoadedModel bound to torch on the CPU (what tests and tools pass)."""
    if isinstance(obj, DeviceRuntime):
        return obj
    return TorchRuntime(Device("cpu", 0, "cpu", "host CPU"), obj)
