"""GGUF checkpoints: config, dequantized weights (Hugging Face names) and tokenizer from one file.

llama.cpp's converter permutes the rows of attn_q / attn_k for its interleaved RoPE; we undo that so
the weights are exactly the Hugging Face ones (rotate-half RoPE) and match transformers. The file is
read by rngd_pd.model.gguf_file (metadata in one struct pass; gguf's reader takes seconds per open).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rngd_pd.errors import ModelLoadError
from rngd_pd.model.config import ModelConfig
from rngd_pd.model.gguf_file import GGUFFile, dequantize
from rngd_pd.model.tokenizer import Tokenizer, tokenizer_from_gguf

_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor (None for tensors we do not use)."""
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    base = gguf_name.removesuffix(".weight")
    return f"{_GLOBAL[base]}.weight" if base in _GLOBAL and gguf_name.endswith(".weight") else None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's rope row permutation of a q/k projection [n_head * hd, D]."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """An opened GGUF file (memory-mapped); tensors are dequantized one at a time on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = [path]
        try:
            self.reader = GGUFFile(path)
        except Exception as e:  # the reader raises ValueError/struct/IndexError on bad bytes
            raise ModelLoadError(
                f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); re-download or re-convert it"
            ) from e
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self.meta("general.architecture")
        if self.arch != "llama":
            raise ModelLoadError(
                f"{path}: architecture {self.arch!r} is not supported; only Llama-family ('llama') models are"
            )

    def count(self) -> int:
        """Number of tensors the model uses (for the progress bar)."""
        return sum(1 for n in self.tensors if hf_name(n))

    def meta(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.meta(f"{self.arch}.{key}", default)

    def config(self) -> ModelConfig:
        """ModelConfig from the {arch}.* and tokenizer.ggml.* metadata."""
        heads = int(self._arch("attention.head_count"))
        hidden = int(self._arch("embedding_length"))
        eos = [self.meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        bos = self.meta("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            vocab_size=int(self._arch("vocab_size", len(self.meta("tokenizer.ggml.tokens") or []))),
            hidden_size=hidden,
            intermediate_size=int(self._arch("feed_forward_length")),
            num_layers=int(self._arch("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._arch("attention.head_count_kv", heads)),
            head_dim=int(self._arch("attention.key_length", hidden // heads)),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            max_context=int(self._arch("context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )

    def _rope_scaling(self) -> dict | None:
        """llama.cpp stores Llama-3.1 scaling as per-frequency factors (rope_freqs.weight)."""
        if "rope_freqs.weight" in self.tensors:
            factors = self._array("rope_freqs.weight").reshape(-1)
            return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
        kind = self._arch("rope.scaling.type")
        if kind in (None, "none"):
            return None
        return {"rope_type": str(kind), "factor": float(self._arch("rope.scaling.factor", 1.0))}

    def _array(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        try:
            return dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{self.path}: tensor {name} cannot be dequantized ({e})") from e

    def hf_tensors(self, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, fp32 array) for every weight the model uses, in file order (numpy:
        this reader stays torch-free for the front end; load_model makes tensors of them)."""
        for name in self.tensors:
            hf = hf_name(name)
            if hf is not None:
                yield hf, self._convert(name, config)

    def hf_tensor(self, hf: str, config: ModelConfig) -> np.ndarray:
        """One weight by its Hugging Face name (a partial update reads only the changed ones)."""
        names = {hf_name(n): n for n in self.tensors}
        if hf not in names:
            raise ModelLoadError(f"{self.path}: no tensor for {hf}")
        return self._convert(names[hf], config)

    def raw_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(Hugging Face name, the stored bytes as they are in the file): what a content hash of
        a checkpoint tensor is taken over, with no dequantization."""
        for name, t in self.tensors.items():
            hf = hf_name(name)
            if hf is not None:
                yield hf, np.ascontiguousarray(t.data).reshape(-1).view(np.uint8)

    def _convert(self, name: str, config: ModelConfig) -> np.ndarray:
        w = self._array(name)
        if ".attn_q." in name:
            w = unpermute(w, config.num_heads)
        elif ".attn_k." in name:
            w = unpermute(w, config.num_kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        return w if w.flags.writeable else w.copy()

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        """Tokenizer, chat template and special tokens from tokenizer.* metadata."""
        tokens = list(self.meta("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelLoadError(f"{self.path}: no tokenizer.ggml.tokens; this GGUF carries no tokenizer")
        tok = tokenizer_from_gguf(
            tokens,
            list(self.meta("tokenizer.ggml.merges") or []),
            list(self.meta("tokenizer.ggml.token_type") or []),
            str(self.meta("tokenizer.ggml.pre", "default")),
            str(self.meta("tokenizer.ggml.model", "gpt2")),
            config.bos_token_id if self.meta("tokenizer.ggml.add_bos_token", False) else None,
        )
        bos = config.bos_token_id
        return Tokenizer(
            tok,
            config.eos_token_ids,
            chat_template=self.meta("tokenizer.chat_template"),
            bos_token=tokens[bos] if bos is not None and bos < len(tokens) else None,
            eos_token=tokens[config.eos_token_ids[0]] if config.eos_token_ids else None,
        )
