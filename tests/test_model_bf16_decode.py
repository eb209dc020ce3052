"""bf16 compute decode (the serving path): oneDNN-packed decode weights give the logits of the plain
weights, and a ragged batched step stays within bf16 rounding of each row alone."""

from __future__ import annotations

import pytest
import torch

from rngd_pd.model import KVCache
from rngd_pd.model import llama as llama_mod
from rngd_pd.model.llama import Llama
from tests import skips

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def bf16_model(smollm) -> Llama:
    """The embedded model's weights in bf16 compute (copied from the fp32 fixture: no second load)."""
    model = Llama(smollm.config, BF16)
    model.load_state_dict(smollm.model.state_dict())
    return model.eval()


def _step_logits(model: Llama, ids: list[list[int]]) -> torch.Tensor:
    """Prefill each prompt into slots 2, 0, 3 (non-consecutive: the gather path), one decode step."""
    cache = KVCache(model.config, 4, 64, BF16)
    slots = [2, 0, 3][: len(ids)]
    for slot, p in zip(slots, ids, strict=True):
        cache.load_all(slot, model.prefill(torch.tensor(p[:-1]), kv_dtype=BF16)[1])
    tokens = torch.tensor([p[-1] for p in ids])
    positions = torch.tensor([len(p) - 1 for p in ids])
    return model.decode_step(tokens, positions, cache, torch.tensor(slots))


def test_packed_decode_weights_match_plain(bf16_model, smollm, monkeypatch):
    if not llama_mod._packable(BF16):
        pytest.skip(f"{skips.NO_NATIVE_BF16}: decode uses the plain weights")
    ids = [smollm.tokenizer.encode(t) for t in ("The river ran", "Bread and music at the", "A quiet city")]
    packed = _step_logits(bf16_model, ids)
    assert bf16_model.head_packed is not None and bf16_model.layers[0].packed is not None
    monkeypatch.setattr(llama_mod, "_packable", lambda dtype: False)
    plain_model = Llama(smollm.config, BF16)
    plain_model.load_state_dict(bf16_model.state_dict())
    plain = _step_logits(plain_model, ids)
    assert plain_model.head_packed is None
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))
    torch.testing.assert_close(packed, plain, rtol=0, atol=0.05)


def test_bf16_batched_ragged_step_close_to_alone(bf16_model, smollm):
    """One step of very ragged rows batched vs each alone: logits within a bf16 rounding.

    Not bit-identical in bf16 compute (nor before the packed weights): a longer attention row
    changes the fp32 summation order of softmax and P@V, which can flip a bf16 rounding, so greedy
    runs of several tokens may diverge at near-ties. fp32 compute is exact (test_model_kv).
    """
    words = ["river", "stone", "light", "morning", "quiet", "city", "bread", "music", "ocean", "garden"]
    texts = [" ".join(words[(b * 3 + i) % 10] for i in range(4 + 14 * b)) for b in range(3)]
    ids = [smollm.tokenizer.encode(t) for t in texts]
    together = _step_logits(bf16_model, ids)
    for b, p in enumerate(ids):
        alone = _step_logits(bf16_model, [p])[0]
        assert int(together[b].argmax()) == int(alone.argmax()), f"row {b}"
        # measured up to 0.25 (2 bf16 ulps at |logit| 16-32)
        torch.testing.assert_close(together[b], alone, rtol=0, atol=0.5)
