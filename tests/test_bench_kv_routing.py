"""bench/kv_routing.py without servers: the chat trace, its arrivals and the opener that puts a round's
system prompt on every pod."""

from __future__ import annotations

import itertools

import numpy as np

from bench import kv_routing
from rngd_pd.model.checkpoint import load_tokenizer


def test_chat_trace_resends_each_history_and_interleaves_the_chats() -> None:
    _, tok = load_tokenizer()
    trace = kv_routing.chat_trace(tok, conversations=3, turns=4, seed=1, salt="t")
    assert sorted(c for c, _ in trace) == [0] * 4 + [1] * 4 + [2] * 4
    assert [c for c, _ in trace] != sorted(c for c, _ in trace)  # interleaved, not chat by chat
    for chat in range(3):
        turns = [ids for c, ids in trace if c == chat]
        for earlier, later in itertools.pairwise(turns):
            assert later[:len(earlier)] == earlier and len(later) > len(earlier) + 100  # reply + new message
    assert trace == kv_routing.chat_trace(tok, conversations=3, turns=4, seed=1, salt="t")


def test_the_opener_shares_every_system_prompt_block_with_the_trace() -> None:
    _, tok = load_tokenizer()
    trace = kv_routing.chat_trace(tok, conversations=8, turns=2, seed=5, salt="r0-events")
    opener = kv_routing.chat_trace(tok, 1, 1, seed=5, salt="r0-events")[0][1]
    system = tok.encode(tok.apply_chat_template([{"role": "system", "content": "x"}]))
    shared = min(common(opener, ids) for _, ids in trace)
    assert shared >= 100 > len(system)  # the whole system prompt, not only the template's header
    assert all(ids != opener for _, ids in trace)  # the opener is a chat of its own


def common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_arrivals_are_a_seeded_poisson_process_at_the_rate() -> None:
    times = np.array(kv_routing.arrivals(4000, rate=2.5, seed=3))
    gaps = np.diff(times, prepend=0.0)
    assert (gaps > 0).all() and abs(gaps.mean() - 1 / 2.5) < 0.02
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential gaps: coefficient of variation 1
    assert kv_routing.arrivals(10, 2.5, 3) == times[:10].tolist()
