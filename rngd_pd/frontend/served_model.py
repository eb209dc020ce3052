"""Load what the front end knows of the served model: tokenizer, context limit, vocabulary size.

Through `rngd_pd.model.load_tokenizer`: only the checkpoint's metadata and tokenizer are read (GGUF
header, or config.json + tokenizer files), never the weights, and torch is not imported, so a gateway
pod needs no weight files and starts with little memory.
"""

from __future__ import annotations

from pathlib import Path

from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.frontend.prompts import ServedModel
from rngd_pd.model.checkpoint import embedded_model_path, load_tokenizer


def default_model_name(path: Path) -> str:
    """`SmolLM2-135M-Instruct` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`; a directory's own name."""
    path = path.expanduser()
    return path.name if path.is_dir() else path.name.split(".")[0]


def load_served_model(config: FrontendConfig) -> ServedModel:
    """The tokenizer and limits of `config.model_path` (None = the embedded model the server uses).

    `max_model_len` is the checkpoint's context, or `--max-model-len` when smaller; the app lowers it
    further to what the Triton model serves once it has asked (FrontendState.context_model).
    """
    model_config, tokenizer = load_tokenizer(config.model_path)
    limit = model_config.max_context
    if config.max_model_len is not None:
        limit = min(limit, config.max_model_len)
    path = embedded_model_path() if config.model_path is None else Path(config.model_path)
    return ServedModel(
        name=config.served_model_name or default_model_name(path),
        tokenizer=tokenizer,
        max_model_len=limit,
        vocab_size=model_config.vocab_size,
    )
