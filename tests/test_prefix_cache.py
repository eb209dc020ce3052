"""Prefix reuse in prefill (rngd_pd.engine.prefix): same tokens and KV as without it, bounded, LRU,
correct under concurrent requests."""

from __future__ import annotations

import threading

import numpy as np
import torch

from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.engine.kv_events.hashing import block_hashes, none_hash
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.prefix import PrefixCache
from rngd_pd.model.generate import greedy
from rngd_pd.model.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=1)
SYSTEM = ("You are a careful assistant for a shipping company. Answer in one sentence, name the port, "
          "the vessel and the date, and never invent a tracking number that the customer did not give.")


def chat(tok, question: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": question}]))


def test_block_names_chain_over_the_whole_prefix() -> None:
    a = np.arange(100, dtype=np.int64)
    b = a.copy()
    b[5] = 7  # differs in block 0: every later block's name differs too
    root = none_hash()
    na, nb = block_hashes(a.tolist(), 32, root), block_hashes(b.tolist(), 32, root)
    assert len(na) == 3 and na[0] != nb[0] and na[2] != nb[2]
    assert block_hashes(a[:64].tolist(), 32, root) == na[:2]


def test_cached_prefill_equals_uncached_fp32(smollm) -> None:
    """A prompt that shares the system prompt with an earlier one: only its new tokens are computed,
    the KV handed on is the whole prompt's, equal to a cold prefill; greedy tokens equal the oracle."""
    tok = smollm.tokenizer
    cold = PrefillEngine(smollm, kv_dtype=torch.float32, chunk_size=32)
    warm = PrefillEngine(smollm, kv_dtype=torch.float32, chunk_size=32, prefix_cache_bytes=64 << 20,
                         prefix_block=16)
    first, second = chat(tok, "Where is my parcel?"), chat(tok, "Which ship carries container 7?")
    assert warm.prefill("a", first, GREEDY).cached_tokens == 0
    seen: list[tuple[int, int]] = []
    hot = warm.prefill("b", second, GREEDY, on_layer=lambda i, k, v: seen.append((i, k.shape[1])))
    ref = cold.prefill("b", second, GREEDY)
    shared = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert hot.cached_tokens == shared // 16 * 16 > 0
    assert seen == [(i, len(second)) for i in range(smollm.config.num_layers)]
    assert hot.first_token == ref.first_token
    for (k1, v1), (k2, v2) in zip(hot.kv, ref.kv, strict=True):
        torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)
    stats = warm.prefix_cache.stats()
    assert stats.hit_tokens == hot.cached_tokens and stats.queried_tokens == len(first) + len(second)
    # the same prompt again: everything but its last token comes from the cache
    again = warm.prefill("c", second, GREEDY)
    assert again.cached_tokens == (len(second) - 1) // 16 * 16 and again.first_token == ref.first_token


def test_colocated_with_prefix_reuse_equals_the_oracle(smollm) -> None:
    tok = smollm.tokenizer
    with ColocatedEngine(smollm, max_len=256, kv_dtype=torch.float32, chunk_size=32,
                         prefix_cache_bytes=64 << 20) as eng:
        for question in ("Where is my parcel?", "Where is my parcel now?", "Name the vessel."):
            ids = chat(tok, question)
            res = eng.generate(ids, SamplingParams(max_tokens=8))
            assert res.token_ids == greedy(smollm.model, ids, 8, torch.float32, smollm.config.eos_token_ids)
        assert eng.prefill_engine.prefix_cache.stats().hit_tokens > 0


def test_bounded_lru_keeps_parents_and_evicts_leaves(smollm) -> None:
    c = smollm.config
    runtime = as_runtime(smollm)
    cache = PrefixCache(runtime, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32,
                        capacity_bytes=0, block=4)
    block_bytes = cache.block_bytes
    cache = PrefixCache(runtime, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32,
                        capacity_bytes=3 * block_bytes, block=4)

    def kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.randn(c.num_kv_heads, n, c.head_dim), torch.randn(c.num_kv_heads, n, c.head_dim))
                for _ in range(c.num_layers)]

    a = np.arange(13, dtype=np.int64)  # 3 full blocks
    assert cache.insert(a, kv(13)) == 3
    b = np.concatenate([a[:8], np.arange(100, 105)])  # shares 2 blocks, adds one
    assert cache.match(b)[0] == 8
    assert cache.insert(b, kv(13), cached_tokens=8) == 1
    stats = cache.stats()
    assert stats.blocks == 3 and stats.bytes <= stats.capacity_bytes and stats.evicted_blocks == 1
    assert cache.match(b)[0] == 12  # b's chain whole
    assert cache.match(a)[0] == 8   # a's leaf went (the oldest), its parents stayed
    cache.clear()
    assert cache.match(a)[0] == 0


def test_concurrent_prefills_share_one_cache(smollm) -> None:
    """Threads prefilling prompts with shared prefixes on one engine at once: every result equals a
    cold prefill."""
    tok = smollm.tokenizer
    warm = PrefillEngine(smollm, kv_dtype=torch.float32, chunk_size=64, prefix_cache_bytes=32 << 20,
                         prefix_block=8)
    cold = PrefillEngine(smollm, kv_dtype=torch.float32, chunk_size=64)
    prompts = [chat(tok, q) for q in ("Where?", "When?", "Which vessel?", "Which port?", "Where?")]
    refs = [cold.prefill(f"r{i}", p, GREEDY).first_token for i, p in enumerate(prompts)]
    assert warm.prefill("prime", prompts[0], GREEDY).first_token == refs[0]  # the shared system prompt
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

    def run(i: int) -> None:
        got[i].append(warm.prefill(f"w{i}", prompts[i], GREEDY).first_token)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(len(prompts))] == [[r, r] for r in refs]
    assert warm.prefix_cache.stats().hit_rate > 0.5


def test_a_prompt_prefilled_in_cached_chunks_equals_one_prefilled_whole_fp32(smollm) -> None:
    """pd's chunked prefill: cache_prefix of the prompt's first 32 and 64 tokens, then the prompt;
    the last request computes only the rest, its KV and first token equal a whole prefill's, and the
    hit rate counts none of the request's own chunks (only the system prompt another request cached)."""
    tok = smollm.tokenizer
    cold = PrefillEngine(smollm, kv_dtype=torch.float32, chunk_size=32)
    warm = PrefillEngine(smollm, kv_dtype=torch.float32, chunk_size=32, prefix_cache_bytes=64 << 20,
                         prefix_block=16)
    other = chat(tok, "Where is my parcel?")
    ids = chat(tok, "Which ship carries container 7, and when does it reach Rotterdam, Hamburg or Antwerp?")
    assert len(ids) > 64
    warm.prefill("other", other, GREEDY)
    shared = next(i for i, (x, y) in enumerate(zip(other, ids, strict=False)) if x != y) // 16 * 16
    before = warm.prefix_cache.stats()
    reused = 0
    for head in (32, 64):
        cached, got = warm.cache_prefix("req", ids[:head])
        assert cached == head
        reused += got
    hot = warm.prefill("req", ids, GREEDY)
    ref = cold.prefill("req", ids, GREEDY)
    assert hot.first_token == ref.first_token
    for (k1, v1), (k2, v2) in zip(hot.kv, ref.kv, strict=True):
        torch.testing.assert_close(k1, k2, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v1, v2, atol=1e-4, rtol=1e-4)
    after = warm.prefix_cache.stats()
    assert after.queried_tokens - before.queried_tokens == len(ids)
    assert after.hit_tokens - before.hit_tokens == reused + hot.cached_tokens == min(shared, 64)
    assert warm.cache_prefix("x", ids[:40]) == (32, 32)  # a partial block is not kept; another's are reused
    assert cold.cache_prefix("y", ids[:32]) == (0, 0)  # no prefix cache: nothing kept, say so
