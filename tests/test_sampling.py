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
