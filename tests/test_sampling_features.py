"""Logprobs, n, penalties, logit_bias, min_tokens and stop_token_ids in the engines, against outside
references: transformers' log-softmax on the same checkpoint (fp32, teacher-forced) for logprobs, and
the formulas of OpenAI's and vLLM's documentation, written out here, for the penalties.

* OpenAI (API reference, "frequency and presence penalties"):
  mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c[j] = how often token j
  was sampled so far; `logit_bias` is added to the logits before sampling.
* vLLM (`SamplingParams.repetition_penalty`): tokens that appeared in the prompt or the output so far
  have positive logits divided by the penalty and negative ones multiplied by it; `min_tokens`: EOS
  and `stop_token_ids` cannot be generated before that many tokens; vLLM v1 applies logit_bias and
  min_tokens before the penalties.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.model.sampling import Sampler, SamplingParams

LOGPROB_ATOL = 1e-4


def reference_adjust(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
                     eos: tuple[int, ...]) -> torch.Tensor:
    """The documented formulas, one token at a time, in float64."""
    x = logits.double().clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in (*(() if p.ignore_eos else eos), *p.stop_token_ids):
            x[token] = -math.inf
    if p.repetition_penalty != 1:
        for token in set(prompt) | set(output):
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
    return x


@pytest.fixture(scope="module")
def colocated(smollm):
    with ColocatedEngine(smollm, num_slots=4, max_len=256, kv_dtype="fp32", chunk_size=16) as engine:
        yield engine


def _run(engine: ColocatedEngine, ids: list[int], params: SamplingParams):
    """Events by choice index, and the prefill result (prompt logprobs)."""
    seen: dict = {}
    by_choice: dict[int, list] = {}
    for ev in engine.stream(ids, params, on_prefill=lambda pre: seen.setdefault("pre", pre)):
        by_choice.setdefault(ev.index, []).append(ev)
    return by_choice, seen["pre"]


@torch.inference_mode()
def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def test_sampler_adjusts_logits_as_the_documented_formulas() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(300, generator=gen) * 4
    prompt, output = [5, 7, 7, 250], [7, 9, 9, 9, 120]
    params = SamplingParams(max_tokens=20, presence_penalty=0.7, frequency_penalty=-0.4,
                            repetition_penalty=1.3, logit_bias=((9, 2.5), (11, -100.0), (299, 7.0)),
                            min_tokens=8, stop_token_ids=(42,))
    sampler = Sampler(params, prompt_ids=prompt, eos_ids=(2,))
    for token in output:
        sampler.record(token)
    ours = sampler.adjust(logits)
    ref = reference_adjust(logits, prompt, output, params, (2,))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    torch.testing.assert_close(ours[finite].double(), ref[finite], atol=1e-5, rtol=0)
    assert int(ours.argmax()) == int(ref.argmax())


def test_logprobs_equal_transformers_teacher_forced(colocated, smollm, hf_smollm) -> None:
    ids = smollm.tokenizer.encode("The three primary colours are")
    params = SamplingParams(max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    by_choice, pre = _run(colocated, ids, params)
    events = by_choice[0]
    out = [ev.token_id for ev in events]
    ref = _hf_logprobs(hf_smollm, ids + out[:-1])
    for step, ev in enumerate(events):
        row = ref[len(ids) - 1 + step]
        lp = ev.logprobs
        assert lp.token == ev.token_id
        assert abs(lp.logprob - float(row[ev.token_id])) < LOGPROB_ATOL
        top = torch.topk(row, 5)
        assert list(lp.ids[1:]) == top.indices.tolist()  # same order
        assert max(abs(a - b) for a, b in zip(lp.values[1:], top.values.tolist(), strict=True)) < LOGPROB_ATOL
    # the prompt's: row i is token i + 1 given tokens 0..i (echo's logprobs)
    assert len(pre.prompt_logprobs) == len(ids) - 1
    for i, lp in enumerate(pre.prompt_logprobs):
        row = ref[i]
        assert lp.token == ids[i + 1]
        assert abs(lp.logprob - float(row[ids[i + 1]])) < LOGPROB_ATOL
        assert list(lp.ids[1:]) == torch.topk(row, 3).indices.tolist()


def test_logprobs_do_not_change_the_tokens(colocated, smollm) -> None:
    ids = smollm.tokenizer.encode("Write a haiku about rain:")
    plain, _ = _run(colocated, ids, SamplingParams(max_tokens=10, temperature=0.8, seed=11))
    with_lp, _ = _run(colocated, ids, SamplingParams(max_tokens=10, temperature=0.8, seed=11, logprobs=2))
    assert [e.token_id for e in plain[0]] == [e.token_id for e in with_lp[0]]
    assert all(e.logprobs is None for e in plain[0])


def test_n_greedy_gives_identical_choices_from_one_prefill(colocated, smollm) -> None:
    ids = smollm.tokenizer.encode("List three fruits:")
    single, _ = _run(colocated, ids, SamplingParams(max_tokens=12, temperature=0))
    prefills_before = _prefill_count(colocated)
    four, _ = _run(colocated, ids, SamplingParams(max_tokens=12, temperature=0, n=4))
    assert _prefill_count(colocated) == prefills_before + 1
    want = [e.token_id for e in single[0]]
    assert sorted(four) == [0, 1, 2, 3]
    assert all([e.token_id for e in four[i]] == want for i in range(4))
    assert colocated.decode_engine.stats()["free_slots"] == 4


def test_n_seeded_sampling_is_reproducible_and_choice_i_uses_seed_plus_i(colocated, smollm) -> None:
    ids = smollm.tokenizer.encode("Name a colour:")
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    a, _ = _run(colocated, ids, params)
    b, _ = _run(colocated, ids, params)
    tokens = {i: [e.token_id for e in a[i]] for i in range(3)}
    assert tokens == {i: [e.token_id for e in b[i]] for i in range(3)}
    assert len({tuple(t) for t in tokens.values()}) > 1  # choices differ
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=1236, ignore_eos=True)
    alone, _ = _run(colocated, ids, seeded)
    assert tokens[2] == [e.token_id for e in alone[0]]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, presence_penalty=1.5, ignore_eos=True),
    SamplingParams(max_tokens=12, frequency_penalty=2.0, ignore_eos=True),
    SamplingParams(max_tokens=12, repetition_penalty=1.8, ignore_eos=True),
    SamplingParams(max_tokens=12, logit_bias=((28, 6.0), (30, 3.0)), presence_penalty=0.5, ignore_eos=True),
], ids=["presence", "frequency", "repetition", "bias+presence"])
def test_penalised_greedy_tokens_follow_the_reference(colocated, smollm, hf_smollm, params) -> None:
    ids = smollm.tokenizer.encode("the the the the the cat cat cat sat on the")
    plain, _ = _run(colocated, ids, SamplingParams(max_tokens=12, ignore_eos=True))
    by_choice, _ = _run(colocated, ids, params)
    out = [e.token_id for e in by_choice[0]]
    assert out != [e.token_id for e in plain[0]]  # the parameters mattered
    with torch.inference_mode():
        logits = hf_smollm(torch.tensor([ids + out[:-1]])).logits[0]
    for step, token in enumerate(out):
        ref = reference_adjust(logits[len(ids) - 1 + step], ids, out[:step], params, ())
        top2 = torch.topk(ref, 2).values
        assert int(ref.argmax()) == token or float(top2[0] - top2[1]) < 1e-3, f"step {step}"


def test_min_tokens_bans_eos_and_stop_token_ids_end_without_text(colocated, smollm) -> None:
    eos = smollm.config.eos_token_ids[0]
    ids = smollm.tokenizer.encode("Hello")
    forced = SamplingParams(max_tokens=10, logit_bias=((eos, 100.0),), min_tokens=3)
    events = _run(colocated, ids, forced)[0][0]
    assert [e.token_id for e in events][-1] == eos and len(events) == 4
    assert events[-1].finish_reason == "eos"
    word = smollm.tokenizer.encode(" banana")[0]
    stop = SamplingParams(max_tokens=10, logit_bias=((word, 100.0),), stop_token_ids=(word,), min_tokens=2)
    events = _run(colocated, ids, stop)[0][0]
    assert len(events) == 3 and events[-1].token_id == word and events[-1].finish_reason == "stop"
    assert "banana" not in "".join(e.text for e in events)


def _prefill_count(engine: ColocatedEngine) -> int:
    return _PREFILLS[id(engine.prefill_engine)]


_PREFILLS: Counter = Counter()


@pytest.fixture(autouse=True)
def _count_prefills(colocated, monkeypatch):
    """Count the prefill engine's prompts (the colocated engine has no Triton counter)."""
    engine = colocated.prefill_engine
    original = type(engine).prefill

    def counted(self, *args, **kwargs):
        _PREFILLS[id(self)] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(engine), "prefill", counted)
