"""Model configuration: the shape facts every part (engine, KV handle, transports) agrees on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from rngd_pd.errors import ConfigError, ContextLengthError


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family model's architecture, context limit and special token ids."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    max_context: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}; "
                "grouped-query attention needs whole groups"
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements (not bytes) of K plus V one token adds across all layers; times the dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def to_json(self) -> str:
        """Canonical JSON (sorted keys) used for the fingerprint and for logs."""
        return json.dumps(asdict(self), sort_keys=True)

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request that cannot fit: empty prompt, max_tokens < 1, or over max_context."""
        check_request(self, prompt_len, max_tokens)


def check_request(config: ModelConfig, prompt_len: int, max_tokens: int) -> None:
    """Raise ConfigError / ContextLengthError for a request the model cannot serve."""
    if prompt_len < 1:
        raise ConfigError("the prompt is empty (0 tokens); send at least one token")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    if prompt_len + max_tokens > config.max_context:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens + max_tokens {max_tokens} = {prompt_len + max_tokens} "
            f"exceeds the model's context of {config.max_context} tokens; shorten the prompt or "
            "lower max_tokens"
        )


def _get(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a config.json in either the old or the v5 layout."""
    params = cfg.get("rope_parameters") or {}
    theta = float(_get(cfg, "rope_theta", default=params.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params or None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else {k: v for k, v in scaling.items() if k != "rope_theta"}
    return theta, scaling


def config_from_hf(cfg: dict[str, Any], eos_ids: tuple[int, ...]) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dictionary (LlamaForCausalLM)."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = rope_from_hf(cfg)
    bos = cfg.get("bos_token_id")
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=hidden // heads)),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", default=1e-6)),
        max_context=int(_get(cfg, "max_position_embeddings", default=2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=eos_ids,
    )
