"""Hugging Face checkpoint directories made for tests and benchmarks: the embedded model exported to
safetensors, a random checkpoint of any Llama shape (Llama-3.1-8B's for the weight bench), and a copy
of a checkpoint with a few tensors changed (what a fine-tuning step writes; a partial update's input).

Each is what `rngd_pd.model.hf_loader` reads: config.json, *.safetensors shards with an index,
tokenizer.json (the embedded model's: its ids fit any vocabulary at least as large),
tokenizer_config.json with its chat template, generation_config.json.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from rngd_pd.model.checkpoint import open_checkpoint
from rngd_pd.model.config import ModelConfig
from rngd_pd.model.layout import hf_shapes
from rngd_pd.model.store import as_torch

LLAMA_31_8B = ModelConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    rms_norm_eps=1e-5, max_context=131072, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_ids=(128001, 128009),
)  # fmt: skip
SHARD_BYTES = 2 << 30


def hf_config(c: ModelConfig) -> dict:
    """config.json of a LlamaForCausalLM with this shape (rngd_pd.model.config reads it back)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_context, "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids),
    }  # fmt: skip


def write_checkpoint(dst: Path, config: ModelConfig, tensors: Iterable[tuple[str, Tensor]],
                     shard_bytes: int = SHARD_BYTES) -> Path:
    """Write a checkpoint directory from (Hugging Face name, tensor), sharded; the embedded model's
    tokenizer and chat template go with it, and so its BOS and EOS ids go into the config (a Llama-3.1
    shape's own ids, 128000+, are not in that tokenizer: no engine could stop on them)."""
    dst.mkdir(parents=True, exist_ok=True)
    embedded = open_checkpoint(None)
    ids = embedded.config()
    config = dataclasses.replace(config, bos_token_id=ids.bos_token_id, eos_token_ids=ids.eos_token_ids)
    (dst / "config.json").write_text(json.dumps(hf_config(config), indent=1))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": list(config.eos_token_ids)}))
    _copy_tokenizer(embedded.tokenizer(ids), dst)
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(_shards(tensors, shard_bytes)):
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _shards(tensors: Iterable[tuple[str, Tensor]], limit: int) -> Iterator[dict[str, Tensor]]:
    shard: dict[str, Tensor] = {}
    size = 0
    for name, t in tensors:
        if shard and size + t.numel() * t.element_size() > limit:
            yield shard
            shard, size = {}, 0
        shard[name] = t.contiguous()
        size += t.numel() * t.element_size()
    if shard:
        yield shard


def _copy_tokenizer(tok: Any, dst: Path) -> None:
    tok.tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token}))


def export_embedded(dst: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The embedded SmolLM2 GGUF as a Hugging Face checkpoint directory in `dtype`."""
    ckpt = open_checkpoint(None)
    config = ckpt.config()
    tensors = ((n, t.to(dtype)) for n, t in as_torch(ckpt.hf_tensors(config)))
    return write_checkpoint(dst, config, tensors, shard_bytes=64 << 20)


def random_checkpoint(dst: Path, config: ModelConfig = LLAMA_31_8B, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> Path:
    """A checkpoint of `config`'s shape with random weights (normal, std 0.02; norms 1), written
    tensor by tensor so memory stays near one shard."""
    gen = torch.Generator().manual_seed(seed)

    def tensors() -> Iterator[tuple[str, Tensor]]:
        for name, shape in hf_shapes(config).items():
            if len(shape) == 1:
                yield name, torch.ones(shape, dtype=dtype)
            else:
                yield name, (torch.randn(shape, generator=gen) * 0.02).to(dtype)

    return write_checkpoint(dst, config, tensors())


def changed_copy(src: Path, dst: Path, names: Sequence[str], scale: float = 0.5, seed: int = 1) -> Path:
    """A copy of checkpoint `src` in which the tensors `names` are perturbed (w + scale * std(w) *
    noise): what one fine-tuning step that touched only those tensors would write. Shards without a
    changed tensor are copied byte for byte."""
    shutil.copytree(src, dst)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    gen = torch.Generator().manual_seed(seed)
    for shard in sorted({index[n] for n in names}):
        with safe_open(str(src / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        for n in names:
            if n in tensors:
                w = tensors[n].float()
                noise = torch.randn(w.shape, generator=gen) * scale * (w.std() + 1e-3)
                tensors[n] = (w + noise).to(tensors[n].dtype)
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return dst
