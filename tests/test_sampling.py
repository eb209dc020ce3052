"""Sampling parameters, the seeded sampler and stop strings (no model needed)."""

from __future__ import annotations

import pytest
import torch

from rngd_pd.errors import ConfigError
from rngd_pd.model.sampling import Sampler, SamplingParams, StopChecker


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop": ["list"]}, "stop"),
        ({"seed": -3}, "seed"),
    ],
)
def test_validate_names_the_bad_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**kwargs).validate()


def test_defaults_are_valid_and_greedy() -> None:
    p = SamplingParams()
    p.validate()
    assert p.greedy


def _logits(seed: int = 0, vocab: int = 1000) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits()
    assert Sampler(SamplingParams()).sample(logits) == int(logits.argmax())


def test_same_seed_same_tokens_different_seed_differs() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    rows = [_logits(i) for i in range(32)]
    s1, s2 = Sampler(params), Sampler(params)
    a = [s1.sample(r) for r in rows]
    b = [s2.sample(r) for r in rows]
    assert a == b
    s3 = Sampler(SamplingParams(temperature=1.0, seed=99))
    c = [s3.sample(r) for r in rows]
    assert a != c


def test_draws_depend_only_on_seed_and_step() -> None:
    """A sampler that starts at step 1 continues exactly where one that drew step 0 would be."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    rows = [_logits(i) for i in range(8)]
    whole = Sampler(params)
    expected = [whole.sample(r) for r in rows]
    rest = Sampler(params, first_step=1)
    assert [Sampler(params).sample(rows[0])] + [rest.sample(r) for r in rows[1:]] == expected


def test_top_k_restricts_to_k_best() -> None:
    logits = _logits()
    best = set(torch.topk(logits, 5).indices.tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, seed=3))
    assert {s.sample(logits) for _ in range(200)} <= best


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.full((100,), -20.0)
    logits[[3, 7, 11]] = torch.tensor([5.0, 4.0, 3.0])  # ~0.66, 0.24, 0.09 of the mass
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=5))
    seen = {s.sample(logits) for _ in range(300)}
    assert seen == {3, 7}
    s1 = Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=5))
    assert {s1.sample(logits) for _ in range(50)} == {3}


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    s = Sampler(SamplingParams(temperature=1.0, seed=11))
    draws = [s.sample(logits) for _ in range(3000)]
    share = draws.count(0) / len(draws)
    assert 0.65 < share < 0.75


def _run_stop(stop: tuple[str, ...], deltas: list[str]) -> tuple[str, bool]:
    sc = StopChecker(stop)
    out = []
    stopped = False
    for d in deltas:
        text, stopped = sc.push(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(sc.flush())
    return "".join(out), stopped


def test_stop_string_spanning_tokens_is_found_and_excluded() -> None:
    assert _run_stop(("END",), ["Hello E", "N", "D and more"]) == ("Hello ", True)


def test_held_back_text_is_released_when_no_match() -> None:
    sc = StopChecker(("STOP",))
    assert sc.push("abc ST") == ("abc ", False)  # "ST" might begin STOP: held back
    assert sc.push("ay") == ("STay", False)
    assert sc.push("ST") == ("", False)
    assert sc.flush() == "ST"


def test_earliest_of_several_stop_strings_wins() -> None:
    assert _run_stop(("world", "lo w"), ["hel", "lo world"]) == ("hel", True)


def test_no_stop_strings_passes_text_through() -> None:
    assert _run_stop((), ["a", "b"]) == ("ab", False)


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (full-sort path) to peaked (top-256 path)
def test_nucleus_equals_the_full_sort(scale: float) -> None:
    from rngd_pd.model.sampling import _nucleus

    probs = torch.softmax(_logits(1, vocab=5000) * scale, dim=-1)
    kept, idx = _nucleus(probs, None, 0.9)
    values, order = torch.sort(probs, descending=True)
    n = int((torch.cumsum(values, 0) < 0.9).sum()) + 1
    assert set(idx.tolist()) == set(order[:n].tolist())
    torch.testing.assert_close(kept, probs[idx])


class _OnlyAllows:
    """A TokenConstraint that admits only `allowed` (the grammar's place in the sampler's order)."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed, self.accepted = allowed, []

    def prepare(self) -> None:
        pass

    def mask_into(self, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[list(self.allowed)] = True
        return torch.where(keep, logits, float("-inf"))

    def allows(self, token: int) -> bool:
        return token in self.allowed

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_raw_logprobs_then_bias_and_penalties_then_the_grammar_then_the_draw(temperature: float) -> None:
    """docs/frontend.md's order: the logprobs are the raw log-softmax whatever the bias and the mask do;
    the bias and penalties act before the mask (a forbidden token's +100 bias cannot let it through, an
    allowed token's -100 cannot shut it out when it is the only one)."""
    logits = _logits(4, vocab=64)
    raw = torch.log_softmax(logits.float(), dim=-1)
    favourite = int(logits.argmax())
    allowed = {3, 17} - {favourite}
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=5, logprobs=4,
                            logit_bias=((favourite, 100.0), (3, -100.0)), presence_penalty=1.5)
    sampler = Sampler(params)
    sampler.record(17)  # 17 was generated once: its presence penalty applies
    got = sampler.choose(logits, _OnlyAllows(allowed))
    assert got.token in allowed
    if temperature == 0:  # argmax of the adjusted, masked row: 3 at -100 loses to 17 at -1.5
        assert got.token == 17
    lp = got.logprobs
    assert lp is not None and lp.token == got.token and len(lp.top) == 4
    assert lp.logprob == pytest.approx(float(raw[got.token]), abs=1e-6)
    values, ids = torch.topk(raw, 4)
    assert [t for t, _ in lp.top] == ids.tolist()  # the raw top 4: the favourite first, though forbidden
    assert lp.top[0][0] == favourite
    torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values)


def test_plain_is_greedy_with_nothing_adjusted_and_no_logprobs() -> None:
    """Only a plain row may take the batch's argmax (decode's fast path, also under a grammar)."""
    assert SamplingParams().plain
    for kw in ({"temperature": 1.0}, {"logprobs": 0}, {"presence_penalty": 0.5}, {"frequency_penalty": -1.0},
               {"repetition_penalty": 1.2}, {"logit_bias": ((1, 2.0),)}, {"min_tokens": 1}):
        assert not SamplingParams(max_tokens=4, **kw).plain, kw
