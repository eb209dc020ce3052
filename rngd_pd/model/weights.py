"""load_model: one entry point for GGUF files, Hugging Face directories and the embedded default.

Loaders yield (Hugging Face name, tensor); `assemble` fuses each layer's projections into the
Llama module as soon as the layer is complete, so peak memory stays near one copy of the model.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from rngd_pd.errors import ModelLoadError
from rngd_pd.host.shm_refs import Root
from rngd_pd.model.checkpoint import (  # noqa: F401 - re-exported: torch-free home of these
    EMBEDDED_PACKAGE,
    embedded_model_path,
    load_tokenizer,
    open_checkpoint,
)
from rngd_pd.model.config import ModelConfig, check_request
from rngd_pd.model.layout import serving_tensors
from rngd_pd.model.llama import Llama
from rngd_pd.model.store import Progress, WeightStore, as_torch, open_store
from rngd_pd.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A ready model: weights, tokenizer, and the fingerprint a KV handle must carry."""

    config: ModelConfig
    model: Llama
    tokenizer: Tokenizer
    fingerprint: str
    source: str
    store: WeightStore | None = None  # the host's weight store the weights are mapped from

    def close(self) -> None:
        """Stop holding the weight store, if any (the last holder on the host removes it)."""
        if self.store is not None:
            self.store.close()

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """ConfigError / ContextLengthError when the request cannot fit this model's context."""
        check_request(self.config, prompt_len, max_tokens)


def load_model(
    path: str | None = None, *, dtype: torch.dtype = torch.float32, progress: bool = True
) -> LoadedModel:
    """Load a GGUF file, a Hugging Face checkpoint directory, or (path None) the embedded model."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ModelLoadError(f"compute dtype {dtype} is not supported; use torch.float32 or torch.bfloat16")
    ckpt = open_checkpoint(path)
    files = ckpt.files  # a directory without weights fails here, before the model is allocated
    config = ckpt.config()
    tokenizer = ckpt.tokenizer(config)
    model = Llama(config, dtype)
    name = ckpt.path.name
    bar = tqdm(
        total=ckpt.count(), desc=f"loading {name}", unit="tensor", file=sys.stderr, disable=not progress
    )
    with torch.inference_mode(), bar:
        assemble(model, _ticking(as_torch(ckpt.hf_tensors(config)), bar))
    model.eval()
    return LoadedModel(config, model, tokenizer, fingerprint(config, files), str(ckpt.path))


def load_shared(path: str | None = None, *, dtype: torch.dtype = torch.float32,
                progress: Progress | None = None, root: Root | None = None) -> LoadedModel:
    """`load_model` through the host's weight store (rngd_pd.model.store): map the checkpoint's
    current generation, converting it first if no process on this host has; `close()` when done."""
    ckpt = open_checkpoint(path)
    config = ckpt.config()
    tokenizer = ckpt.tokenizer(config)
    store = open_store(ckpt, dtype, fingerprint(config, ckpt.files), root=root, progress=progress)
    try:
        return from_store(store, config, tokenizer, str(ckpt.path))
    except BaseException:
        store.close()
        raise


def from_store(store: WeightStore, config: ModelConfig, tokenizer: Tokenizer, source: str) -> LoadedModel:
    """A LoadedModel whose parameters are the store's read-only mappings (no copy)."""
    store.check_config(config)
    model = Llama(config, store.dtype)
    params = parameters(model)
    for name, t in store.tensors.items():
        _check_shape(params[name], t, name)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, nn.Parameter(t, requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head = model.embed
    model.eval()
    return LoadedModel(config, model, tokenizer, store.fingerprint, source, store)


def _ticking(items: Iterable[tuple[str, Tensor]], bar: tqdm) -> Iterable[tuple[str, Tensor]]:
    for item in items:
        yield item
        bar.update(1)


def assemble(model: Llama, tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy Hugging Face-named tensors into the model, fused as rngd_pd.model.layout says."""
    params = parameters(model)
    for name, t in serving_tensors(model.config, tensors):
        _copy(params[name], t, name)


def parameters(model: Llama) -> dict[str, Tensor]:
    """The model's parameters by their layout names (a tied LM head appears once, as `embed`)."""
    return dict(model.named_parameters())


def _copy(dst: Tensor, src: Tensor, what: str) -> None:
    _check_shape(dst, src, what)
    dst.copy_(src)


def _check_shape(dst: Tensor, src: Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(
            f"weight {what} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}; "
            "config and weights do not belong together"
        )


def fingerprint(config: ModelConfig, files: list[Path], samples: int = 16, chunk: int = 1 << 16) -> str:
    """sha256 over the config and, per weight file, its size and evenly spaced byte samples.

    Content-based (not path or mtime), so two hosts holding copies of one checkpoint agree; cheap
    (about 1 MiB read per file).
    """
    h = hashlib.sha256(config.to_json().encode())
    for f in files:
        size = f.stat().st_size
        h.update(str(size).encode())
        with f.open("rb") as fh:
            for k in range(samples):
                fh.seek(max(0, (size - chunk) * k // max(1, samples - 1)))
                h.update(fh.read(chunk))
    return h.hexdigest()[:32]
