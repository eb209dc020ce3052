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

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from rngd_pd.errors import ModelLoadError
from rngd_pd.model.checkpoint import (  # noqa: F401 - re-exported: torch-free home of these
    EMBEDDED_PACKAGE,
    embedded_model_path,
    load_tokenizer,
    open_checkpoint,
)
from rngd_pd.model.config import ModelConfig, check_request
from rngd_pd.model.llama import Llama
from rngd_pd.model.tokenizer import Tokenizer

_LAYER_PARTS = (
    "input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


@dataclass
class LoadedModel:
    """A ready model: weights, tokenizer, and the fingerprint a KV handle must carry."""

    config: ModelConfig
    model: Llama
    tokenizer: Tokenizer
    fingerprint: str
    source: str

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
        assemble(model, _ticking(ckpt.hf_tensors(config), bar))
    model.eval()
    return LoadedModel(config, model, tokenizer, fingerprint(config, files), str(ckpt.path))


def _ticking(items: Iterable[tuple[str, Tensor | np.ndarray]], bar: tqdm) -> Iterable[tuple[str, Tensor]]:
    """Tensors (a GGUF gives numpy arrays, safetensors torch tensors), ticking the progress bar."""
    for name, t in items:
        yield name, torch.from_numpy(t) if isinstance(t, np.ndarray) else t
        bar.update(1)


def assemble(model: Llama, tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy Hugging Face-named tensors into the model, fusing QKV and gate/up per layer."""
    c = model.config
    pending: dict[int, dict[str, Tensor]] = {}
    seen: set[str] = set()
    direct = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    if not c.tie_word_embeddings:
        direct["lm_head.weight"] = model.lm_head
    for name, t in tensors:
        if name in direct:
            _copy(direct[name], t, name)
            seen.add(name)
        elif name.startswith("model.layers."):
            idx, part = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            layer = pending.setdefault(int(idx), {})
            layer[part] = t
            if len(layer) == len(_LAYER_PARTS):
                _fill_layer(model, int(idx), pending.pop(int(idx)))
                seen.add(f"layer {idx}")
    missing = [n for n in direct if n not in seen] + [
        f"layer {i}" for i in range(c.num_layers) if f"layer {i}" not in seen
    ]
    if missing:
        raise ModelLoadError(f"checkpoint lacks weights for {', '.join(missing[:5])}; it is incomplete")


def _fill_layer(model: Llama, i: int, w: dict[str, Tensor]) -> None:
    if i >= len(model.layers):
        raise ModelLoadError(f"checkpoint has layer {i} but the config says {len(model.layers)} layers")
    b = model.layers[i]
    _copy(b.attn_norm, w["input_layernorm"], f"layer {i} input_layernorm")
    _copy(b.ffn_norm, w["post_attention_layernorm"], f"layer {i} post_attention_layernorm")
    qkv = torch.cat([w["self_attn.q_proj"], w["self_attn.k_proj"], w["self_attn.v_proj"]])
    _copy(b.wqkv, qkv, f"layer {i} q/k/v_proj")
    _copy(b.wo, w["self_attn.o_proj"], f"layer {i} o_proj")
    _copy(b.w13, torch.cat([w["mlp.gate_proj"], w["mlp.up_proj"]]), f"layer {i} gate/up_proj")
    _copy(b.w2, w["mlp.down_proj"], f"layer {i} down_proj")


def _copy(dst: Tensor, src: Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ModelLoadError(
            f"weight {what} has shape {tuple(src.shape)}, the config implies {tuple(dst.shape)}; "
            "config and weights do not belong together"
        )
    dst.copy_(src)


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
