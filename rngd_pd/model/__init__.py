"""Llama in plain torch with explicit KV, its weights, tokenizer and config (see docs/model.md).

Names are imported on first use (PEP 562), so `rngd_pd.model.checkpoint`, `.params`, `.stopping` and
`.tokenizer` can be used without importing torch (the OpenAI front end's gateway pod).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rngd_pd.model.cache import KVCache
    from rngd_pd.model.checkpoint import embedded_model_path, load_tokenizer
    from rngd_pd.model.config import ModelConfig, check_request
    from rngd_pd.model.llama import Llama
    from rngd_pd.model.tokenizer import StreamDecoder, Tokenizer
    from rngd_pd.model.weights import LoadedModel, load_model

_HOME = {
    "KVCache": "cache",
    "Llama": "llama",
    "LoadedModel": "weights",
    "ModelConfig": "config",
    "StreamDecoder": "tokenizer",
    "Tokenizer": "tokenizer",
    "check_request": "config",
    "embedded_model_path": "checkpoint",
    "load_model": "weights",
    "load_tokenizer": "checkpoint",
}
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


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
