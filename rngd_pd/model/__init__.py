"""Llama in plain torch with explicit KV, its weights, tokenizer and config (see docs/model.md)."""

from __future__ import annotations

from rngd_pd.model.cache import KVCache
from rngd_pd.model.config import ModelConfig, check_request
from rngd_pd.model.llama import Llama
from rngd_pd.model.tokenizer import StreamDecoder, Tokenizer
from rngd_pd.model.weights import LoadedModel, embedded_model_path, load_model, load_tokenizer

__all__ = [
    "KVCache",
    "Llama",
    "LoadedModel",
    "ModelConfig",
    "StreamDecoder",
    "Tokenizer",
    "check_request",
    "embedded_model_path",
    "load_model",
    "load_tokenizer",
]
