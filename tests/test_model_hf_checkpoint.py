"""The production input path: a Hugging Face checkpoint directory (config.json + sharded safetensors +
tokenizer.json), here a tiny random Llama written by the test (untied embeddings, llama3 rope
scaling, GQA), loads and matches transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from rngd_pd.errors import ModelLoadError
from rngd_pd.model import load_model
from rngd_pd.model.generate import greedy
from rngd_pd.testing.tiny import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, the transformers model) for a 2-layer random Llama (rngd_pd.testing.tiny)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _legacy_layout(src: Path, dst: Path) -> Path:
    """The same checkpoint with config.json in the pre-v5 layout (rope_theta + rope_scaling), as
    Llama-3.1-8B-Instruct ships."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("layout", ["v5", "legacy"])
def test_tiny_checkpoint_matches_transformers(tiny, tmp_path, layout):
    d, hf = tiny
    path = d if layout == "v5" else _legacy_layout(d, tmp_path / "legacy")
    loaded = load_model(str(path), progress=False)
    c = loaded.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert not c.tie_word_embeddings and c.rope_scaling["rope_type"] == "llama3"
    assert c.max_context == 256 and c.eos_token_ids == (2,)
    ids = torch.randint(3, c.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, _ = loaded.model.prefill(torch.tensor(ids), kv_dtype=torch.float32)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    tokens = greedy(loaded.model, ids, 10, kv_dtype=torch.float32)
    with torch.inference_mode():
        hf_next = hf(torch.tensor([ids + tokens[:-1]])).logits[0].argmax(-1).tolist()[len(ids) - 1 :]
    assert hf_next == tokens


def test_tiny_checkpoint_tokenizer_and_template(tiny):
    d, _ = tiny
    tok = load_model(str(d), progress=False).tokenizer
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    text = "<|im_start|>user\nthe quick fox<|im_end|> hello"
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode("<|im_end|>") == [2]
    assert tok.eos_token_ids == (2,)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_bf16_compute_is_close_to_fp32(tiny):
    d, _ = tiny
    ids = torch.arange(3, 60)
    a, _ = load_model(str(d), progress=False).model.prefill(ids, kv_dtype=torch.float32)
    b, kv = load_model(str(d), dtype=torch.bfloat16, progress=False).model.prefill(ids)
    assert b.dtype == torch.float32 and kv[0][0].dtype == torch.bfloat16
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


def test_fingerprint_identifies_weights(tiny, tmp_path):
    d, _ = tiny
    first = load_model(str(d), progress=False).fingerprint
    assert first == load_model(str(d), progress=False).fingerprint
    other = tmp_path / "other"
    shutil.copytree(d, other)
    shard = sorted(other.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-8:] = bytes(8)  # different weights, same size
    shard.write_bytes(bytes(data))
    assert load_model(str(other), progress=False).fingerprint != first


def test_broken_checkpoints_raise_model_load_error(tiny, tmp_path):
    d, _ = tiny
    broken = tmp_path / "truncated"
    shutil.copytree(d, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(str(broken), progress=False)
    arch = tmp_path / "gpt2"
    shutil.copytree(d, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(str(arch), progress=False)
    (arch / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(arch), progress=False)
