"""Load what the front end knows of the served model: tokenizer, context limit, vocabulary size.

Only the checkpoint's metadata and tokenizer are read (GGUF header or config.json + tokenizer.json),
never the weights, so a gateway pod starts in about a second with little memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from rngd_pd.errors import ModelLoadError
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.prompts import ServedModel
from rngd_pd.model.weights import embedded_model_path


def default_model_name(path: Path) -> str:
    """`SmolLM2-135M-Instruct` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`; a directory's own name."""
    return path.name if path.is_dir() else path.name.split(".")[0]


def load_served_model(config: FrontendConfig) -> ServedModel:
    """The tokenizer and limits of `config.model_path` (None = the embedded model the server uses)."""
    path = embedded_model_path() if config.model_path is None else Path(os.path.expanduser(config.model_path))
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory; pass the same --model the server uses")
    if path.is_dir():
        from rngd_pd.model.hf_loader import HFCheckpoint

        ckpt = HFCheckpoint(path)
    elif path.suffix.lower() == ".gguf":
        from rngd_pd.model.gguf_loader import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
    else:
        raise ModelLoadError(f"{path}: expected a *.gguf file or a Hugging Face checkpoint directory")
    model_config = ckpt.config()
    limit = model_config.max_context
    if config.max_model_len is not None:
        limit = min(limit, config.max_model_len)
    return ServedModel(
        name=config.served_model_name or default_model_name(path),
        tokenizer=ckpt.tokenizer(model_config),
        max_model_len=limit,
        vocab_size=model_config.vocab_size,
    )
