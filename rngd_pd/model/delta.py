"""Partial update: the next generation of a weight store from a checkpoint that changed in places.

A fine-tuning loop rewrites a checkpoint in which a few tensors changed. `apply_delta` compares it with
the store tensor by tensor by content hash (xxh3-128 over each tensor's bytes in the file; the store
recorded the previous checkpoint's), reads and converts only the tensors that differ, and writes a
new generation in which every stored parameter none of whose parts changed is a hard link to the
previous generation's file (the same tmpfs pages: no copy) and each touched one is a copy with the
changed rows replaced. The new generation has a new fingerprint, so KV computed with the old weights
is refused by a decode that serves the new ones (rngd_pd.kv.handle). Switching the serving instances
over is rngd_pd.stubs.weights's job; this module only makes and maps the generation.

The new fingerprint is derived from the old one and the changed tensors' hashes, not sampled from
the files as a fresh load's is (rngd_pd.model.weights.fingerprint): every instance that applies the
same delta to the same generation agrees on it, on every host.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from rngd_pd.errors import ModelLoadError
from rngd_pd.host.shm_refs import Root, store_root
from rngd_pd.model.checkpoint import open_checkpoint
from rngd_pd.model.config import ModelConfig
from rngd_pd.model.layout import layout, owners, row_ranges
from rngd_pd.model.store import (
    TENSORS,
    Checkpoint,
    Progress,
    WeightStore,
    key_of,
    map_store,
    source_digests,
    write_manifest,
    write_tensor,
)


@dataclass
class DeltaReport:
    """What a partial update did (logged, and returned by the endpoint and `rngd-pd apply-delta`)."""

    checkpoint: str
    old_fingerprint: str
    new_fingerprint: str
    generation: int
    changed: list[str] = field(default_factory=list)  # checkpoint tensors whose content differs
    params: list[str] = field(default_factory=list)  # stored parameters rewritten
    bytes_hashed: int = 0  # checkpoint bytes read to compare (every tensor)
    bytes_read: int = 0  # checkpoint bytes read and converted (the changed tensors only)
    bytes_written: int = 0  # bytes written to the new generation (the touched parameters)
    bytes_shared: int = 0  # bytes the new generation shares with the previous one (hard links)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def summary(self) -> str:
        return (f"{len(self.changed)} changed tensors ({', '.join(self.changed[:4])}"
                f"{', ...' if len(self.changed) > 4 else ''}): "
                f"{self.bytes_read >> 20} MiB read and converted, "
                f"{self.bytes_hashed >> 20} MiB hashed, {self.bytes_written >> 20} MiB written, "
                f"{self.bytes_shared >> 20} MiB shared; fingerprint {self.old_fingerprint} -> "
                f"{self.new_fingerprint} (generation {self.generation}) in {self.seconds:.2f} s")


def _read(ckpt: Checkpoint, name: str, config: ModelConfig) -> Tensor:
    t = ckpt.hf_tensor(name, config)
    return torch.from_numpy(t) if isinstance(t, np.ndarray) else t


def fingerprint_after(old: str, changed: dict[str, str]) -> str:
    """The fingerprint of a generation made from `old` by the changed tensors (name -> hash)."""
    h = hashlib.sha256(old.encode())
    for name in sorted(changed):
        h.update(f"\n{name}={changed[name]}".encode())
    return h.hexdigest()[:32]


def apply_delta(store: WeightStore, path: str, *, root: Root | None = None,
                progress: Progress | None = None) -> tuple[WeightStore | None, DeltaReport]:
    """The generation of `store` updated to checkpoint `path` (made here unless another process on
    this host made it already), mapped and held; None when nothing changed. The caller holds both
    generations until it has switched over, then closes the old one."""
    t0 = time.monotonic()
    root = root or store_root()
    ckpt = open_checkpoint(path)
    config = ckpt.config()
    store.check_config(config)
    say = progress or (lambda text: None)
    say(f"delta {path}: hashing the checkpoint's tensors")
    sources, hashed = source_digests(ckpt.raw_tensors())
    used = owners(config)
    missing = sorted(n for n in used if n not in sources)
    if missing:
        raise ModelLoadError(f"{path}: lacks {', '.join(missing[:5])}; a partial update needs a whole "
                             "checkpoint")
    changed = {n: d for n, d in sources.items() if n in used and store.sources.get(n) != d}
    report = DeltaReport(str(ckpt.path), store.fingerprint, store.fingerprint, store.generation,
                         sorted(changed), bytes_hashed=hashed)
    if not changed:
        report.seconds = time.monotonic() - t0
        return None, report
    report.new_fingerprint = fingerprint_after(store.fingerprint, changed)
    report.generation = store.generation + 1
    key = key_of(report.new_fingerprint, store.dtype)
    hold = root.build(key)
    try:
        if hold.path.name != key:
            _write(hold.path, store, ckpt, config, changed, sources, report, say)
            root.publish(hold, key)
        new = map_store(hold)
    except BaseException:
        hold.release()
        raise
    report.seconds = time.monotonic() - t0
    say(f"delta {path}: {report.summary()}")
    return new, report


def _write(directory: Path, store: WeightStore, ckpt: Checkpoint, config: ModelConfig,
           changed: dict[str, str], sources: dict[str, str], report: DeltaReport, say: Progress) -> None:
    """Fill a building directory: links for untouched parameters, patched copies for touched ones."""
    (directory / TENSORS).mkdir()
    owner = owners(config)
    touched = sorted({owner[n] for n in changed})
    entries = dict(store.manifest["tensors"])
    for param, entry in store.manifest["tensors"].items():
        if param not in touched:
            os.link(store.path / TENSORS / param, directory / TENSORS / param)
            report.bytes_shared += entry["nbytes"]
    parts = layout(config)
    for i, param in enumerate(touched):
        t = store.tensors[param].clone()
        ranges = row_ranges(config, param)
        for hf in parts[param]:
            if hf in changed:
                new = _read(ckpt, hf, config)
                if t[ranges[hf]].shape != new.shape:
                    raise ModelLoadError(f"{ckpt.path}: {hf} has shape {tuple(new.shape)}, which does not "
                                         f"fit rows {ranges[hf]} of {param} {tuple(t.shape)}")
                t[ranges[hf]] = new.to(t.dtype)
                report.bytes_read += new.numel() * new.element_size()
        entry = write_tensor(directory, param, t)
        entries[param] = entry
        report.bytes_written += entry["nbytes"]
        say(f"delta: {i + 1}/{len(touched)} parameters rewritten ({param})")
    report.params = touched
    write_manifest(directory, {**store.manifest, "fingerprint": report.new_fingerprint,
                               "generation": report.generation, "source": report.checkpoint,
                               "tensors": entries, "sources": sources})

