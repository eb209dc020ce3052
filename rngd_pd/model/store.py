"""The weight store: a checkpoint converted once per host, mapped read-only by every instance.

Prefill, decode, colocated, and any instance Triton loads later (a reload, a variant swap, an added
instance) map the same files in /dev/shm instead of each reading and converting the checkpoint: a
model that fits the host once is served by all of them (Llama-3.1-8B in bf16: 16 GB, not 16 GB per
process). What each instance needs for itself (decode's packed weights, a GPU's copy) is derived
from the mapped tensors. The lifetime is rngd_pd.host.shm_refs: held by the processes that map it,
removed with the last one, a crash included.

    <root>/<fingerprint>-<dtype>/      one generation of one checkpoint in one compute dtype
      manifest.json                    config, fingerprint, each tensor's shape and xxh3-128 of its
                                       bytes, and each checkpoint tensor's content hash (for deltas)
      t/<param>                        a parameter in the serving layout (rngd_pd.model.layout), raw
      .holders/<pid>-<n>               flocked by each process that maps it
    <root>/<base>.current              the generation instances started now map (after a delta)

A generation is written under a building name and renamed into place once complete (manifest last),
so a store that can be held is whole; every mapper still hashes each tensor against the manifest
and refuses a store whose bytes differ. `apply_delta` (rngd_pd.model.delta) makes the next generation.
"""

from __future__ import annotations

import json
import logging
import mmap
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch import Tensor

from rngd_pd.config.dtypes import short_dtype, torch_dtype
from rngd_pd.errors import ModelLoadError
from rngd_pd.host.shm_refs import Hold, Root, store_root
from rngd_pd.model.config import ModelConfig
from rngd_pd.model.gguf_loader import GGUFCheckpoint
from rngd_pd.model.hf_loader import HFCheckpoint
from rngd_pd.model.layout import serving_tensors

VERSION = 1
MANIFEST = "manifest.json"
TENSORS = "t"
log = logging.getLogger(__name__)
Progress = Callable[[str], None]
Checkpoint = GGUFCheckpoint | HFCheckpoint


def digest(data: Any) -> str:
    """The content hash of tensors and checkpoint tensors: xxh3-128 (~25 GB/s here)."""
    return xxhash.xxh3_128_hexdigest(data)


def as_bytes(t: Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass
class WeightStore:
    """One held, mapped generation. `tensors` are read-only mappings (writing one faults)."""

    hold: Hold
    manifest: dict[str, Any]
    tensors: dict[str, Tensor] = field(repr=False)

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def base(self) -> str:
        """The name of the generation this one descends from (its pointer's name)."""
        return self.manifest["base"]

    @property
    def generation(self) -> int:
        return self.manifest["generation"]

    @property
    def key(self) -> str:
        return self.hold.name

    @property
    def path(self) -> Path:
        return self.hold.path

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.manifest["dtype"])

    def check_config(self, config: ModelConfig) -> None:
        """ModelLoadError when the store was made for another architecture than `config`."""
        if self.manifest["config"] != config.to_json():
            raise ModelLoadError(f"weight store {self.path}: made for another model config than this "
                                 "checkpoint's; it is refused")

    @property
    def sources(self) -> dict[str, str]:
        """Checkpoint tensor name -> its content hash."""
        return self.manifest["sources"]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def close(self) -> None:
        """Stop holding it (the mappings stay valid while tensors reference them)."""
        self.hold.release()


def key_of(fingerprint: str, dtype: torch.dtype) -> str:
    return f"{fingerprint}-{short_dtype(dtype)}"


def open_store(ckpt: Checkpoint, dtype: torch.dtype, fingerprint: str, *, root: Root | None = None,
               progress: Progress | None = None) -> WeightStore:
    """Map the current generation of the opened checkpoint `ckpt` (fingerprint:
    rngd_pd.model.weights.fingerprint of it) in `dtype`, building it first when no process on this
    host has."""
    root = root or store_root()
    base = key_of(fingerprint, dtype)
    for _ in range(8):  # a generation can vanish between finding it and holding it: look again
        current = root.current(base)
        hold = root.hold(current) if current else None
        if hold is None:
            hold = root.build(base)
            if hold.path.name != base:
                try:
                    write_generation(hold.path, ckpt, dtype, fingerprint, base, progress)
                    root.publish(hold, base)
                except BaseException:
                    hold.release()
                    raise
        try:
            return map_store(hold)
        except BaseException:
            hold.release()
            raise
    raise ModelLoadError(f"{root.path}: the weight store of {base} kept disappearing while being opened")


def write_generation(directory: Path, ckpt: Checkpoint, dtype: torch.dtype, fingerprint: str, base: str,
                     progress: Progress | None = None) -> None:
    """Convert the whole checkpoint into `directory` (a building directory this process holds)."""
    t0 = time.monotonic()
    config = ckpt.config()
    sources, hashed = source_digests(ckpt.raw_tensors())
    (directory / TENSORS).mkdir()
    entries = {}
    for name, t in serving_tensors(config, as_torch(ckpt.hf_tensors(config))):
        entries[name] = write_tensor(directory, name, t.to(dtype).contiguous())
    write_manifest(directory, {
        "version": VERSION, "fingerprint": fingerprint, "base": base, "generation": 0,
        "dtype": short_dtype(dtype), "config": config.to_json(), "source": str(ckpt.path),
        "tensors": entries, "sources": sources,
    })
    size = sum(e["nbytes"] for e in entries.values())
    _say(progress, f"weight store {base}: built, {len(entries)} tensors, {size >> 20} MiB "
                   f"({hashed >> 20} MiB of checkpoint hashed) in {time.monotonic() - t0:.1f} s")


def as_torch(items: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Tensor]]:
    """Checkpoint tensors as torch tensors (a GGUF gives numpy arrays, safetensors torch tensors)."""
    for name, t in items:
        yield name, torch.from_numpy(t) if isinstance(t, np.ndarray) else t


def source_digests(raw: Iterable[tuple[str, Any]]) -> tuple[dict[str, str], int]:
    """Content hash of every checkpoint tensor, and the bytes read for them."""
    out, total = {}, 0
    for name, data in raw:
        out[name] = digest(data)
        total += memoryview(data).nbytes
    return out, total


def write_tensor(directory: Path, name: str, t: Tensor) -> dict[str, Any]:
    """Write one serving tensor; its manifest entry."""
    data = as_bytes(t)
    with open(directory / TENSORS / name, "wb") as f:
        f.write(memoryview(data))
    return {"shape": list(t.shape), "nbytes": data.nbytes, "hash": digest(data)}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    tmp.rename(directory / MANIFEST)


def map_store(hold: Hold) -> WeightStore:
    """Map every tensor of a held generation read-only, checking each against its recorded hash."""
    try:
        manifest = json.loads((hold.path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"weight store {hold.path}: no readable manifest ({e}); it is not a store "
                             "this version wrote") from e
    if manifest.get("version") != VERSION:
        raise ModelLoadError(f"weight store {hold.path}: format {manifest.get('version')}, this version "
                             f"reads {VERSION}")
    dtype = torch_dtype(manifest["dtype"])
    tensors = {}
    for name, entry in manifest["tensors"].items():
        data = _map(hold.path / TENSORS / name)
        if data.nbytes != entry["nbytes"] or digest(data) != entry["hash"]:
            raise ModelLoadError(
                f"weight store {hold.path}: tensor {name} does not match its recorded hash; the store is "
                "damaged and is refused. Stop the servers using it (it is removed with its last user)")
        with warnings.catch_warnings():  # read-only on purpose: torch warns that it cannot write
            warnings.simplefilter("ignore", UserWarning)
            tensors[name] = torch.from_numpy(data).view(dtype).view(entry["shape"])
    return WeightStore(hold, manifest, tensors)


def _map(path: Path) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), dtype=np.uint8)


def _say(progress: Progress | None, text: str) -> None:
    log.info("%s", text)
    if progress is not None:
        progress(text)

