"""Explicit KV in and out (bf16 KV): prefill vs token-by-token cache, batched ragged decode vs alone,
chunked prefill, per-layer callback, cache and step validation."""

from __future__ import annotations

import pytest
import torch

from rngd_pd.errors import ConfigError
from rngd_pd.model import KVCache
from rngd_pd.model.generate import greedy, greedy_batch

BF16 = torch.bfloat16


def _ids(tok, n: int, seed: int) -> list[int]:
    """A natural-text prompt of exactly n tokens (different text per seed)."""
    words = ["river", "stone", "light", "morning", "quiet", "city", "bread", "music", "ocean", "garden"]
    text = " ".join(words[(seed * 7 + i * (seed + 3)) % len(words)] for i in range(2 * n + 8))
    return tok.encode(f"Story {seed}: {text}")[:n]


@torch.inference_mode()
def test_decode_after_prefill_equals_cache_built_token_by_token(smollm):
    model, ids = smollm.model, _ids(smollm.tokenizer, 14, seed=1)
    expected = greedy(model, ids, 8, kv_dtype=BF16)
    cache = KVCache(smollm.config, 2, 32, BF16)
    logits, kv = model.prefill(torch.tensor(ids[:1]), kv_dtype=BF16)
    cache.load_all(1, kv)
    slot = torch.tensor([1])
    for pos in range(1, len(ids)):
        logits = model.decode_step(torch.tensor([ids[pos]]), torch.tensor([pos]), cache, slot)[0]
    out = [int(logits.argmax())]
    for pos in range(len(ids), len(ids) + 7):
        logits = model.decode_step(torch.tensor([out[-1]]), torch.tensor([pos]), cache, slot)[0]
        out.append(int(logits.argmax()))
    assert out == expected


_ALONE: dict[int, list[int]] = {}


def _ragged(tok, b: int) -> list[int]:
    return _ids(tok, 5 + (b * 13) % 41, seed=b)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_batched_ragged_decode_equals_alone(smollm, batch):
    prompts = [_ragged(smollm.tokenizer, b) for b in range(batch)]
    together = greedy_batch(smollm.model, prompts, 8, kv_dtype=BF16)
    for b in sorted({0, batch // 2, batch - 1}):  # first, middle, last row; "alone" runs are shared
        if b not in _ALONE:
            _ALONE[b] = greedy(smollm.model, prompts[b], 8, kv_dtype=BF16)
        assert together[b] == _ALONE[b], f"row {b} of {batch}"


@torch.inference_mode()
def test_non_contiguous_slots_match_contiguous(smollm):
    model, tok = smollm.model, smollm.tokenizer
    prompts = [_ids(tok, 9, seed=3), _ids(tok, 17, seed=4)]
    caches = [KVCache(smollm.config, 4, 32, BF16) for _ in range(2)]
    for cache, slots in zip(caches, ([0, 1], [3, 1]), strict=True):
        for slot, p in zip(slots, prompts, strict=True):
            cache.load_all(slot, model.prefill(torch.tensor(p), kv_dtype=BF16)[1])
    tokens, positions = torch.tensor([11, 22]), torch.tensor([9, 17])
    a = model.decode_step(tokens, positions, caches[0], torch.tensor([0, 1]))
    b = model.decode_step(tokens, positions, caches[1], torch.tensor([3, 1]))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_chunked_prefill_and_on_layer(smollm):
    model, ids = smollm.model, torch.tensor(_ids(smollm.tokenizer, 40, seed=5))
    seen: list[int] = []
    whole, kv = model.prefill(ids, on_layer=lambda i, k, v: seen.append(i), kv_dtype=torch.float32)
    assert seen == list(range(smollm.config.num_layers))
    assert kv[0][0].shape == (smollm.config.num_kv_heads, 40, smollm.config.head_dim)
    assert kv[0][0].dtype == torch.float32
    _, first = model.prefill(ids[:25], kv_dtype=torch.float32)
    last, second = model.prefill(ids[25:], past=first, kv_dtype=torch.float32)
    torch.testing.assert_close(last, whole, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first[3][1], second[3][1]], dim=1), kv[3][1], atol=1e-4, rtol=1e-4)


def test_kv_dtype_is_honoured(smollm):
    for dtype in (torch.bfloat16, torch.float16):
        _, kv = smollm.model.prefill(torch.tensor([1, 2, 3]), kv_dtype=dtype)
        assert all(k.dtype == dtype and v.dtype == dtype for k, v in kv)


def test_cache_and_step_validation(smollm):
    cfg, model = smollm.config, smollm.model
    cache = KVCache(cfg, 2, 8, BF16)
    assert cache.k[0].shape == (2, cfg.num_kv_heads, 8, cfg.head_dim)
    good = torch.zeros(cfg.num_kv_heads, 4, cfg.head_dim)
    with pytest.raises(ConfigError, match="slot"):
        cache.load(2, 0, good, good)
    with pytest.raises(ConfigError, match="max_len"):
        cache.load(0, 0, good, good, start=6)
    with pytest.raises(ConfigError, match="shape"):
        cache.load(0, 0, torch.zeros(1, 4, cfg.head_dim), torch.zeros(1, 4, cfg.head_dim))
    with pytest.raises(ConfigError, match="positions"):
        model.decode_step(torch.tensor([1]), torch.tensor([8]), cache, torch.tensor([0]))
    with pytest.raises(ConfigError, match="distinct"):
        model.decode_step(torch.tensor([1, 2]), torch.tensor([0, 0]), cache, torch.tensor([1, 1]))
