"""Hugging Face transformers as the reference from outside the project (device conformance, the
dtype checks in tests/).

transformers reads the checkpoint with its own loader (for a GGUF: the `gguf` package, dequantized
by transformers) and runs its own Llama, so a mistake in this project's weight loading, layout or
kernels shows as a difference from it; a check of the project against a second copy of itself
cannot see those. transformers is a heavy, optional dependency (the `test` extra): it is imported
only when a reference is loaded, with an install hint when it is missing.

    ref = Reference.load(None, "fp32")          # the embedded SmolLM2 GGUF; a path like load_model's
    logits, kv = ref.score(ids)                 # teacher-forced: fp32 logits [T, vocab], K/V per layer
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rngd_pd.config.dtypes import short_dtype, torch_dtype
from rngd_pd.errors import ModelLoadError
from rngd_pd.model.checkpoint import open_checkpoint

INSTALL_HINT = "install the test extra: pip install 'transformers>=4.46' accelerate sentencepiece"


def _transformers() -> Any:
    try:
        import transformers  # heavy and optional: only the reference needs it
    except ImportError as exc:
        raise ModelLoadError(f"the reference needs transformers ({exc}); {INSTALL_HINT}") from None
    return transformers


@functools.lru_cache(maxsize=4)
def hf_model(path: str | None = None, dtype: Any = "fp32") -> Any:
    """transformers' model of the checkpoint at `path` (None: the embedded model) in `dtype`, loaded
    by transformers itself in that dtype (as its users load it: a bf16 load keeps RoPE's inverse
    frequencies in fp32, a converted fp32 model would round them), once per process (~15-40 s)."""
    ckpt = open_checkpoint(path)
    where = ckpt.path
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if where.is_file():  # a GGUF: transformers dequantizes it with its own loader
        where, kwargs["gguf_file"] = where.parent, where.name
    model = _transformers().AutoModelForCausalLM.from_pretrained(str(where), **kwargs)
    return model.eval()


def _layers_kv(cache: Any) -> list[tuple[Tensor, Tensor]]:
    """(K, V) [kv_heads, T, head_dim] per layer from transformers' cache (5.x `layers`, 4.x lists)."""
    if hasattr(cache, "layers"):
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    return [(k[0], v[0]) for k, v in zip(cache.key_cache, cache.value_cache, strict=True)]


class Reference:
    """One transformers model in one dtype: what it computes for a whole token sequence."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.dtype = short_dtype(model.dtype)

    @classmethod
    def load(cls, path: str | None = None, dtype: Any = "fp32") -> Reference:
        """The reference for the checkpoint load_model(path) reads (None: the embedded model)."""
        return cls(hf_model(None if path is None else str(path), short_dtype(dtype)))

    def score(self, ids: Sequence[int]) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One forward pass over `ids` (teacher forcing): fp32 logits [T, vocab] of every position
        (row i predicts token i + 1) and each layer's K/V [kv_heads, T, head_dim] after RoPE, in the
        reference's dtype (this project's KV layout: HF's rotate-half convention)."""
        with torch.inference_mode():
            out = self.model(torch.tensor([list(ids)], dtype=torch.long), use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return out.logits[0].float(), _layers_kv(cache)
