"""The serving layout: which Hugging Face tensors make each of Llama's parameters.

`Llama` fuses q/k/v and gate/up into one matrix each; a checkpoint stores them apart. This table is
the one place that says so. `load_model` fills a module from it, the weight store (rngd_pd.model.store)
writes its tensors in this layout, and a partial update finds from it which rows of which stored
tensor a changed checkpoint tensor lands in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from rngd_pd.errors import ModelLoadError
from rngd_pd.model.config import ModelConfig

# parameter of one Block -> the Hugging Face parts of model.layers.<i>, concatenated along rows
_BLOCK_PARTS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_layernorm",),
    "wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "wo": ("self_attn.o_proj",),
    "ffn_norm": ("post_attention_layernorm",),
    "w13": ("mlp.gate_proj", "mlp.up_proj"),
    "w2": ("mlp.down_proj",),
}


def layout(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Parameter name (as `Llama.named_parameters()` spells it) -> its Hugging Face tensors, in row
    order. A tied LM head is the embedding and has no entry of its own."""
    out: dict[str, tuple[str, ...]] = {"embed": ("model.embed_tokens.weight",),
                                       "norm": ("model.norm.weight",)}
    if not config.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight",)
    for i in range(config.num_layers):
        for param, parts in _BLOCK_PARTS.items():
            out[f"layers.{i}.{param}"] = tuple(f"model.layers.{i}.{p}.weight" for p in parts)
    return out


def owners(config: ModelConfig) -> dict[str, str]:
    """Hugging Face tensor name -> the parameter it is part of."""
    return {hf: param for param, parts in layout(config).items() for hf in parts}


def serving_tensors(config: ModelConfig, hf: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(parameter name, fused tensor) as soon as all of a parameter's parts have arrived, so peak
    memory stays near one layer beyond the output. Tensors the model does not use are skipped; a
    layer beyond the config's, or a part that never comes, is a ModelLoadError."""
    table = layout(config)
    owner = owners(config)
    pending: dict[str, dict[str, Tensor]] = {}
    done: set[str] = set()
    for name, t in hf:
        param = owner.get(name)
        if param is None:
            if name.startswith("model.layers.") and int(name.split(".")[2]) >= config.num_layers:
                raise ModelLoadError(f"checkpoint has {name} but the config says {config.num_layers} layers")
            continue
        parts = pending.setdefault(param, {})
        parts[name] = t
        if len(parts) == len(table[param]):
            del pending[param]
            done.add(param)
            ordered = [parts[p] for p in table[param]]
            yield param, ordered[0] if len(ordered) == 1 else torch.cat(ordered)
    missing = [p for p in table if p not in done]
    if missing:
        raise ModelLoadError(f"checkpoint lacks weights for {', '.join(missing[:5])}; it is incomplete")


def hf_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor of a Llama of this config, in layout order."""
    q, kv, d, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    by_part = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "self_attn.q_proj": (q, d),
               "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q),
               "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
    out: dict[str, tuple[int, ...]] = {}
    for parts in layout(c).values():
        for hf in parts:
            if hf.startswith("model.layers."):
                out[hf] = by_part[hf.split(".", 3)[3].removesuffix(".weight")]
            else:  # embed_tokens and lm_head [vocab, d], the final norm [d]
                out[hf] = (d,) if hf == "model.norm.weight" else (c.vocab_size, d)
    return out


def row_ranges(c: ModelConfig, param: str) -> dict[str, slice]:
    """Where each Hugging Face part of `param` sits among its rows."""
    shapes = hf_shapes(c)
    out, start = {}, 0
    for hf in layout(c)[param]:
        rows = shapes[hf][0]
        out[hf] = slice(start, start + rows)
        start += rows
    return out
