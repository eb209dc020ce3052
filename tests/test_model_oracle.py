"""Greedy tokens of our Llama (fp32 compute, fp32 KV) equal Hugging Face transformers on the same GGUF.

Ours runs prefill + decode_step; HF is checked by teacher forcing: one forward pass over prompt +
our 32 tokens must put its argmax on each of our tokens. That is exactly "HF greedy generates the
same 32 tokens", at the cost of one forward pass instead of 32 decode steps.
"""

from __future__ import annotations

import pytest
import torch

from rngd_pd.model.generate import greedy_batch

NEW_TOKENS = 32
_LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within fifty years presses operated in more than two hundred European cities, and the price "
    "of books fell so sharply that literacy spread among merchants and artisans. Scholars argue "
    "about how much the press caused the Reformation, the scientific revolution and the rise of "
    "newspapers, but few doubt that it changed how ideas travelled. "
)


def _prompts(tok) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "Give me three tips for learning to cook."}])
    long_text = " ".join(f"Part {i}. {_LONG}" for i in range(1, 6)) + "\nSummary in one sentence:"
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea,",
        "Q: What is 17 times 23?\nA:",
        chat,
        long_text,
    ]
    return [tok.encode(t) for t in texts]


@torch.inference_mode()
def _hf_argmax(hf, ids: list[int]) -> list[int]:
    return hf(torch.tensor([ids])).logits[0].argmax(dim=-1).tolist()


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(smollm, hf_smollm):
    prompts = _prompts(smollm.tokenizer)
    assert any(len(p) > 400 for p in prompts), [len(p) for p in prompts]
    assert smollm.tokenizer.encode("<|im_start|>") == [1]
    # All six decode together (ragged lengths, one batched step per token): the cheap way to run
    # 6 x 32 steps here; that a batch equals decoding alone is tested in test_model_kv.py.
    outs = greedy_batch(smollm.model, prompts, NEW_TOKENS, kv_dtype=torch.float32)
    for ids, ours in zip(prompts, outs, strict=True):
        assert len(ours) == NEW_TOKENS
        hf_next = _hf_argmax(hf_smollm, ids + ours[:-1])[len(ids) - 1 :]
        assert hf_next == ours, f"prompt of {len(ids)} tokens diverges at {_first_diff(hf_next, ours)}"


def test_prefill_logits_match_transformers(smollm, hf_smollm):
    ids = smollm.tokenizer.encode("A quick check that the logits agree:")
    ours, _ = smollm.model.prefill(torch.tensor(ids), kv_dtype=torch.float32)
    with torch.inference_mode():
        ref = hf_smollm(torch.tensor([ids])).logits[0, -1]
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), -1)
