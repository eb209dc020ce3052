"""bf16 compute against transformers in bf16, teacher-forced, through the device runtime.

bf16 is what `auto` serves on AVX512-BF16 hosts (this one) and the RNGD graphs' dtype; where `auto`
picks fp32, tests/test_model_oracle.py holds the served tokens equal to transformers'. In bf16 two
implementations round differently, so tokens may part at a near-tie, and greedy runs then diverge
for good: the comparison is teacher-forced. Four prompts, each followed by its fp32 greedy
continuation (the tokens a greedy request serves; equal to transformers', test_model_oracle), run
the way serving runs them: prefill (one chunk, bf16 KV) into scattered slots of a decode cache, then
one batched decode step per position for the four rows, each fed the continuation's next token.
transformers in bf16 scores each prompt + continuation in one pass. At every position: is our
top-1 token transformers' top-1, and how far apart are the logits. docs/model.md has the figures.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rngd_pd.devices import conformance
from rngd_pd.devices.runtime import GraphShapes
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.model.generate import greedy_batch
from rngd_pd.model.llama import Llama
from rngd_pd.model.reference import Reference

STEPS = 79                 # decode steps per prompt: 80 positions each with the prefill's
MIN_AGREEMENT = 0.97       # top-1 agreement over the 320 positions (measured 0.984: docs/model.md)
MAX_LOGIT_DIFF = 2.0       # max |logit diff| at any position (measured 1.10: docs/model.md)
TIE = conformance.TOLERANCES["bf16"].tie  # a differing top-1 must be a near-tie of transformers'


@pytest.fixture(scope="module")
def bf16_runtime(smollm):
    """TorchRuntime over the embedded model's weights in bf16 (a copy of the fp32 fixture's)."""
    model = Llama(smollm.config, torch.bfloat16)
    model.load_state_dict(smollm.model.state_dict())
    runtime = as_runtime(dataclasses.replace(smollm, model=model.eval()))
    runtime.prepare(GraphShapes(prefill_chunks=(512,), decode=((8, 512),), dtype="bf16"))
    return runtime


def _prompts(tok) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "Give me three tips for learning to cook."}])
    texts = [chat, "def fibonacci(n):\n    ", "The history of the printing press begins in the fifteenth "
             "century, when", "Q: What is 17 times 23?\nA:"]
    return [tok.encode(t) for t in texts]


def test_bf16_agrees_with_transformers_bf16_teacher_forced(smollm, hf_smollm, bf16_runtime) -> None:
    prompts = _prompts(smollm.tokenizer)
    continuations = greedy_batch(smollm.model, prompts, STEPS + 1, kv_dtype=torch.float32)
    slots = conformance.scattered_slots(len(prompts), 8)
    ours = conformance.decode_logits(bf16_runtime, prompts, 8, 512, STEPS, 512, "bf16", slots,
                                     forced=[c[:STEPS] for c in continuations])
    ref = Reference.load(None, "bf16")
    theirs = [ref.score(p + c[:STEPS])[0][len(p) - 1:] for p, c in zip(prompts, continuations, strict=True)]
    got, want = torch.cat(ours), torch.cat(theirs)
    assert got.shape == want.shape == (len(prompts) * (STEPS + 1), smollm.config.vocab_size)
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    diff = (got - want).abs()
    differ, margins = conformance.compare_tokens(got, want)
    print(f"\nbf16 vs transformers bf16, {len(got)} positions: top-1 agreement {agree:.4f} ({differ} "
          f"differ, transformers' margins {[round(m, 3) for m in margins]}), max|logit diff| "
          f"{float(diff.max()):.3f}, mean {float(diff.mean()):.4f}")
    assert agree >= MIN_AGREEMENT
    assert float(diff.max()) <= MAX_LOGIT_DIFF
    assert all(m <= TIE for m in margins), margins
