"""Greedy generation loops over prefill + decode_step: the reference the engine and tests compare to.

Kept small and obvious on purpose (no sampling, no stop strings): these are oracles, not the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rngd_pd.model.cache import KVCache
from rngd_pd.model.llama import Llama


def greedy(
    model: Llama,
    prompt: Sequence[int],
    max_new_tokens: int,
    kv_dtype: torch.dtype = torch.bfloat16,
    eos_ids: Sequence[int] = (),
) -> list[int]:
    """Greedy tokens for one prompt: prefill once, then decode one token per step (slot 0)."""
    return greedy_batch(model, [prompt], max_new_tokens, kv_dtype, eos_ids)[0]


@torch.inference_mode()
def greedy_batch(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    kv_dtype: torch.dtype = torch.bfloat16,
    eos_ids: Sequence[int] = (),
) -> list[list[int]]:
    """Greedy tokens for B prompts of any lengths, decoded together in one batched step per token.

    Each prompt is prefilled alone into its own cache slot; a row that hit EOS stops growing (it
    keeps stepping with the batch, its extra tokens are dropped).
    """
    longest = max(len(p) for p in prompts)
    cache = KVCache(model.config, len(prompts), longest + max_new_tokens, kv_dtype)
    outs: list[list[int]] = []
    for slot, p in enumerate(prompts):
        logits, kv = model.prefill(torch.tensor(list(p), dtype=torch.long), kv_dtype=kv_dtype)
        cache.load_all(slot, kv)
        outs.append([int(logits.argmax())])
    positions = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    slots = torch.arange(len(prompts))
    done = [o[-1] in eos_ids for o in outs]
    for _ in range(max_new_tokens - 1):
        if all(done):
            break
        tokens = torch.tensor([o[-1] for o in outs], dtype=torch.long)
        nxt = model.decode_step(tokens, positions, cache, slots).argmax(dim=-1).tolist()
        positions += 1
        for b, t in enumerate(nxt):
            if not done[b]:
                outs[b].append(int(t))
                done[b] = t in eos_ids
    return outs
