"""Hugging Face checkpoint directories: config.json, *.safetensors (sharded or not), tokenizer files.

This is how production models (Llama-3.1-8B-Instruct) arrive. Tensors are read one at a time from
memory-mapped safetensors so peak memory stays near the model's own size.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from rngd_pd.errors import ModelLoadError
from rngd_pd.model.config import ModelConfig, config_from_hf
from rngd_pd.model.tokenizer import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from torch import Tensor

_ARCHS = {"LlamaForCausalLM"}


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.exists():
        if required:
            raise ModelLoadError(f"{path} is missing; a Hugging Face checkpoint directory needs it")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e}); re-download the checkpoint") from e


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class HFCheckpoint:
    """An opened checkpoint directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cfg = _read_json(path / "config.json")
        archs = set(self.cfg.get("architectures") or [])
        if not (archs & _ARCHS or self.cfg.get("model_type") == "llama"):
            raise ModelLoadError(
                f"{path / 'config.json'}: architecture {sorted(archs) or self.cfg.get('model_type')} is "
                "not supported; only Llama-family checkpoints (LlamaForCausalLM) are"
            )
        self.tok_cfg = _read_json(path / "tokenizer_config.json", required=False)

    @cached_property
    def files(self) -> list[Path]:
        """The safetensors files, checked on first use: a tokenizer-only directory (a gateway pod
        that never loads weights) opens fine; `load_model` on it raises ModelLoadError here."""
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            names = sorted(set(_read_json(index).get("weight_map", {}).values()))
            files = [self.path / n for n in names]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(
                f"{self.path}: no *.safetensors files; only safetensors weights are supported"
            )
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f} is listed in the index but missing; re-download the checkpoint")
        return files

    def eos_ids(self) -> tuple[int, ...]:
        gen = _read_json(self.path / "generation_config.json", required=False)
        eos = gen.get("eos_token_id", self.cfg.get("eos_token_id"))
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return tuple(int(i) for i in ids)

    def config(self) -> ModelConfig:
        try:
            return config_from_hf(self.cfg, self.eos_ids())
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{self.path / 'config.json'}: missing or bad field {e}") from e

    def count(self) -> int:
        """Number of tensors across the files (for the progress bar)."""
        return sum(len(self._open(f).keys()) for f in self.files)

    def _open(self, f: Path) -> Any:
        try:
            return safe_open(str(f), framework="pt")
        except Exception as e:  # SafetensorError on a truncated or corrupt header
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e}); re-download it") from e

    def hf_tensors(self, config: ModelConfig) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) for every tensor, file by file."""
        for f in self.files:
            handle = self._open(f)
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, self._get(f, handle, name)

    def hf_tensor(self, name: str, config: ModelConfig) -> Tensor:
        """One tensor by name (a partial update reads only the changed ones)."""
        for f in self.files:
            handle = self._open(f)
            if name in handle.keys():  # noqa: SIM118
                return self._get(f, handle, name)
        raise ModelLoadError(f"{self.path}: no tensor {name}")

    def _get(self, f: Path, handle: Any, name: str) -> Tensor:
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{f}: tensor {name} cannot be read ({e}); re-download it") from e

    def raw_tensors(self) -> Iterator[tuple[str, memoryview]]:
        """(name, the tensor's bytes in the file, through a read-only mapping): what a content hash
        of a checkpoint tensor is taken over. The safetensors layout: an 8-byte little-endian header
        length, the JSON header (data_offsets relative to its end), the data."""
        for f in self.files:
            try:
                with f.open("rb") as fh:
                    (size,) = struct.unpack("<Q", fh.read(8))
                    header = json.loads(fh.read(size))
                    data = memoryview(mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ))
            except (OSError, ValueError, struct.error) as e:
                raise ModelLoadError(f"{f}: not a readable safetensors file ({e}); re-download it") from e
            for name, meta in header.items():
                if name != "__metadata__":
                    start, end = meta["data_offsets"]
                    yield name, data[8 + size + start:8 + size + end]

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        path = self.path / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{path} is missing; only fast tokenizers (tokenizer.json) are supported")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot be parsed ({e})") from e
        template = self.tok_cfg.get("chat_template")
        jinja = self.path / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return Tokenizer(
            tok,
            config.eos_token_ids,
            chat_template=template,
            bos_token=_token_text(self.tok_cfg.get("bos_token")),
            eos_token=_token_text(self.tok_cfg.get("eos_token")),
        )
