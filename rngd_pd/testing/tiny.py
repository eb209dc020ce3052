"""A tiny random Llama checkpoint directory (config.json, sharded safetensors, tokenizer.json, a
chat template), written by transformers itself: the Hugging Face input path in tests, and the model
of `bench/device_check.sh` on a machine that can fetch nothing (the embedded GGUF, 98 MB, is over
what the device tool carries). Needs transformers and tokenizers (the test extra; the GPU image
has both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# llama3 rope scaling, so the checkpoint exercises it
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}  # fmt: skip
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def write_tokenizer(path: Path) -> int:
    """Train a tiny byte-level BPE with three special tokens into path/tokenizer.json; its vocab size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 30]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()


def write_tiny_llama(path: str | Path, seed: int = 0, max_context: int = 256) -> tuple[Path, Any]:
    """(the checkpoint directory, the transformers model) of a 2-layer random Llama with GQA,
    untied embeddings and llama3 rope scaling; weights drawn wide (initializer_range 0.2) so that
    greedy tokens are not near-ties."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(d)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
        rope_theta=10000.0, rope_scaling=dict(ROPE), tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(d, max_shard_size="100KB")  # several shards + model.safetensors.index.json
    tok_cfg = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}
    (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return d, hf
