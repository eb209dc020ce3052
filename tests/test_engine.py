"""Prefill, decode (continuous batching) and colocated engines on the embedded SmolLM2 model."""

from __future__ import annotations

import threading

import pytest
import torch

from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.engine.decode import DecodeEngine
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.request import DecodeRequest, PrefillResult, RequestState, TokenEvent
from rngd_pd.errors import CapacityError, ConfigError, ContextLengthError, RngdPdError, TransportError
from rngd_pd.model.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8)
TEXT = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew "
        "strange potions in an old tower near the sea and count the stars")
WORDS = TEXT.split(" ")


def prompt(tokenizer, n_words: int, offset: int = 0) -> list[int]:
    words = [WORDS[(offset + i) % len(WORDS)] for i in range(n_words)]
    return tokenizer.encode(" ".join(words))


class Collector:
    """emit target: keeps every event of one request and signals the final one."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, ev: TokenEvent) -> None:
        self.events.append(ev)
        if ev.finished:
            self.done.set()

    def wait(self, timeout: float = 120.0) -> list[int]:
        assert self.done.wait(timeout), "no final event"
        assert sum(e.finished for e in self.events) == 1
        return [e.token_id for e in self.events if e.token_id is not None]

    @property
    def final(self) -> TokenEvent:
        return self.events[-1]


def request(
    key: str, pre: PrefillResult, params: SamplingParams, load_kv=None
) -> tuple[DecodeRequest, Collector]:
    col = Collector()
    load = load_kv or (lambda cache, slot: cache.load_all(slot, pre.kv))
    return DecodeRequest(key, pre.num_tokens, pre.first_token, params, load, col), col


@pytest.fixture(scope="module")
def prefiller(smollm) -> PrefillEngine:
    return PrefillEngine(smollm, chunk_size=None)


@pytest.fixture(scope="module")
def engine(smollm):
    eng = DecodeEngine(smollm, num_slots=16, max_len=160, buckets=[64, 160], max_queue=4)
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def ragged(smollm, prefiller) -> list[tuple[list[int], SamplingParams, list[int]]]:
    """16 ragged prompts, each decoded alone (batch of one): the reference tokens."""
    cases = []
    with DecodeEngine(smollm, num_slots=1, max_len=160, buckets=[160]) as alone:
        for i in range(16):
            ids = prompt(smollm.tokenizer, 3 + 5 * i, offset=i)
            params = SamplingParams(max_tokens=3 + i % 4, ignore_eos=True)
            req, col = request(f"alone-{i}", prefiller.prefill(f"alone-{i}", ids, params), params)
            alone.submit(req)
            cases.append((ids, params, col.wait()))
    return cases


def test_batched_greedy_equals_alone(engine, prefiller, ragged) -> None:
    cols = []
    for i, (ids, params, _) in enumerate(ragged):
        req, col = request(f"batch-{i}", prefiller.prefill(f"batch-{i}", ids, params), params)
        engine.submit(req)
        cols.append(col)
    for (_, params, expected), col in zip(ragged, cols, strict=True):
        assert col.wait() == expected
        assert len(expected) == params.max_tokens and col.final.finish_reason == "length"
    stats = engine.stats()
    assert stats["free_slots"] == 16 and stats["active"] == 0


def test_chunked_prefill_equals_whole(smollm, prefiller, ragged) -> None:
    ids, params, expected = ragged[-1]  # the longest prompt
    chunked = PrefillEngine(smollm, chunk_size=16)
    seen = []
    pre = chunked.prefill("chunked", ids, params, on_layer=lambda i, k, v: seen.append((i, k.shape[1])))
    whole = prefiller.prefill("whole", ids, params)
    assert seen == [(i, len(ids)) for i in range(smollm.config.num_layers)]
    assert pre.first_token == whole.first_token == expected[0]
    for (k1, v1), (k2, v2) in zip(pre.kv, whole.kv, strict=True):
        torch.testing.assert_close(k1.float(), k2.float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(v1.float(), v2.float(), atol=0.05, rtol=0.02)
    with DecodeEngine(smollm, num_slots=1, max_len=160, buckets=[160]) as eng:
        req, col = request("chunked", pre, params)
        eng.submit(req)
        assert col.wait() == expected


def test_seeded_sampling_reproducible_alone_and_in_a_batch(engine, prefiller, smollm) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    ids = prompt(smollm.tokenizer, 12)
    runs = []
    for batch in (1, 3):
        cols = []
        for j in range(batch):
            p = params if j == 0 else SamplingParams(max_tokens=6, temperature=1.0, seed=j)
            req, col = request(f"seed-{batch}-{j}", prefiller.prefill(f"seed-{batch}-{j}", ids, p), p)
            engine.submit(req)
            cols.append(col)
        runs.append(cols[0].wait())
        for c in cols[1:]:
            c.wait()
    assert runs[0] == runs[1]


def test_stop_string_spanning_tokens(engine, prefiller, smollm) -> None:
    ids = prompt(smollm.tokenizer, 10)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    req, col = request("nostop", prefiller.prefill("nostop", ids, params), params)
    engine.submit(req)
    col.wait()
    text = "".join(e.text for e in col.events)
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert len(stop.strip()) >= 2
    params2 = SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,))
    req, col2 = request("stop", prefiller.prefill("stop", ids, params2), params2)
    engine.submit(req)
    col2.wait()
    assert col2.final.finish_reason == "stop"
    assert "".join(e.text for e in col2.events) == text[: text.index(stop)]


def test_first_token_can_finish_without_loading_kv(engine, prefiller, smollm) -> None:
    params = SamplingParams(max_tokens=1)
    pre = prefiller.prefill("one", prompt(smollm.tokenizer, 5), params)

    def never(cache, slot):
        raise AssertionError("load_kv must not run")

    req, col = request("one", pre, params, load_kv=never)
    engine.submit(req)
    assert col.done.is_set() and col.wait() == [pre.first_token]
    assert col.final.finish_reason == "length"


def test_eos_and_text_bookkeeping(smollm) -> None:
    tok = smollm.tokenizer
    eos = smollm.config.eos_token_ids[0]
    state = RequestState("k", SamplingParams(max_tokens=10), tok, smollm.config.eos_token_ids)
    ids = tok.encode(" hello world")
    evs = [state.advance(t) for t in ids] + [state.advance(eos)]
    assert evs[-1].finished and evs[-1].finish_reason == "eos" and evs[-1].token_id == eos
    assert state.text == " hello world" and not any(e.finished for e in evs[:-1])
    state2 = RequestState("k", SamplingParams(max_tokens=10, ignore_eos=True), tok, (eos,))
    assert not state2.advance(eos).finished


def test_load_error_fails_only_that_request(engine, prefiller, smollm, ragged) -> None:
    ids, params, expected = ragged[2]

    def broken(cache, slot):
        raise TransportError("relay went away")

    bad_req, bad = request("bad", prefiller.prefill("bad", ids, params), params, load_kv=broken)
    good_req, good = request("good", prefiller.prefill("good", ids, params), params)
    engine.submit(bad_req)
    engine.submit(good_req)
    assert good.wait() == expected
    bad.wait()
    assert bad.final.finish_reason == "error" and isinstance(bad.final.error, TransportError)
    assert engine.stats()["free_slots"] == 16


def test_a_slow_kv_load_does_not_stall_running_streams(engine, prefiller, smollm, ragged) -> None:
    ids, params, expected = ragged[1]
    gate = threading.Event()
    pre = prefiller.prefill("slow", ids, params)

    def slow(cache, slot):
        assert gate.wait(60)
        cache.load_all(slot, pre.kv)

    slow_req, slow_col = request("slow", pre, params, load_kv=slow)
    fast_req, fast_col = request("fast", pre, params)
    engine.submit(slow_req)
    engine.submit(fast_req)
    assert fast_col.wait() == expected  # finished while the other KV was still "arriving"
    assert not slow_col.done.is_set() and engine.stats()["loading"] == 1
    gate.set()
    assert slow_col.wait() == expected


def test_queue_full_then_cancel_frees_everything(smollm, prefiller) -> None:
    gate = threading.Event()
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    pre = prefiller.prefill("q", prompt(smollm.tokenizer, 4), params)

    def slow(cache, slot):
        gate.wait(30)
        cache.load_all(slot, pre.kv)

    with DecodeEngine(smollm, num_slots=1, max_len=128, buckets=[128], max_queue=1) as eng:
        a, ca = request("a", pre, params, load_kv=slow)
        b, cb = request("b", pre, params)
        eng.submit(a)
        eng.submit(b)
        with pytest.raises(CapacityError, match="queue full"):
            eng.submit(request("c", pre, params)[0])
        with pytest.raises(ConfigError, match="already in flight"):
            eng.submit(request("a", pre, params)[0])
        assert eng.cancel("b") and not eng.cancel("nope")
        cb.wait()
        assert cb.final.finish_reason == "cancelled"
        gate.set()
        while len(ca.events) < 3:  # a is decoding now
            ca.done.wait(0.01)
        assert eng.stats()["active"] == 1 and eng.stats()["free_slots"] == 0
        eng.cancel("a")
        ca.wait()
        assert ca.final.finish_reason == "cancelled" and ca.final.token_id is None
        assert eng.stats()["free_slots"] == 1


def test_submit_errors_and_bucket_choice(smollm, prefiller) -> None:
    short = prefiller.prefill("e", prompt(smollm.tokenizer, 4), GREEDY)
    long = prefiller.prefill("f", prompt(smollm.tokenizer, 30), GREEDY)
    eng = DecodeEngine(smollm, num_slots=2, max_len=64, buckets=[32, 64])
    with pytest.raises(RngdPdError, match="not running"):
        eng.submit(request("x", short, GREEDY)[0])
    with eng:
        with pytest.raises(ContextLengthError, match="64"):
            eng.submit(request("x", short, SamplingParams(max_tokens=61))[0])
        lengths = []

        def load(pre):
            def load_kv(cache, slot):
                lengths.append(cache.max_len)
                cache.load_all(slot, pre.kv)
            return load_kv

        cols = []
        for key, pre in (("s", short), ("l", long)):
            req, col = request(key, pre, SamplingParams(max_tokens=4, ignore_eos=True), load_kv=load(pre))
            eng.submit(req)
            cols.append(col)
        assert [len(c.wait()) for c in cols] == [4, 4]
        assert sorted(lengths) == [32, 64]  # each took the smallest bucket that holds it
        assert eng.stats()["buckets"] == {32: 0, 64: 0}


def test_stop_gives_every_request_a_final_event(smollm, prefiller) -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    pre = prefiller.prefill("s", prompt(smollm.tokenizer, 4), params)
    eng = DecodeEngine(smollm, num_slots=1, max_len=64, buckets=[64])
    eng.start()
    cols = []
    for k in ("s1", "s2"):
        req, col = request(k, pre, params)
        eng.submit(req)
        cols.append(col)
    eng.stop()
    for col in cols:
        col.wait(5)
        assert col.final.finish_reason == "error" and "stopped" in str(col.final.error)


def test_prefill_validation(prefiller) -> None:
    with pytest.raises(ConfigError, match="empty"):
        prefiller.prefill("p", [], GREEDY)
    with pytest.raises(ConfigError, match="vocabulary"):
        prefiller.prefill("p", [1, 10**6], GREEDY)
    with pytest.raises(ContextLengthError, match="8192"):
        prefiller.prefill("p", [1] * 8190, GREEDY)
    with pytest.raises(ConfigError, match="top_p"):
        prefiller.prefill("p", [1, 2], SamplingParams(top_p=2.0))


def test_colocated_generate_and_stream(smollm, ragged) -> None:
    ids, params, expected = ragged[5]
    with ColocatedEngine(smollm, num_slots=2, max_len=128, chunk_size=8) as eng:
        res = eng.generate(ids, params)
        assert res.token_ids == expected and res.finish_reason == "length"
        assert res.text == smollm.tokenizer.decode(expected)
        stream = eng.stream(ids, SamplingParams(max_tokens=50, ignore_eos=True), key="early")
        next(stream)
        stream.close()  # closing the iterator cancels the request
        for _ in range(500):
            if eng.decode_engine.stats()["free_slots"] == 2:
                break
            threading.Event().wait(0.01)
        assert eng.decode_engine.stats()["free_slots"] == 2


def test_colocated_fp32_equals_the_oracle_loop(smollm) -> None:
    """Engine (chunked prefill, scheduler, RequestState) == the plain greedy loop that
    test_model_oracle checks against transformers; `rngd-pd generate` equals the engine."""
    from rngd_pd.model.generate import greedy

    tok = smollm.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name two rivers."}]))
    long = prompt(tok, 90, offset=3)
    with ColocatedEngine(smollm, max_len=160, kv_dtype=torch.float32, chunk_size=32) as eng:
        for ids in (chat, long):
            res = eng.generate(ids, SamplingParams(max_tokens=12))
            oracle = greedy(smollm.model, ids, 12, torch.float32, smollm.config.eos_token_ids)
            assert res.token_ids == oracle


def test_concurrent_submits_and_cancels_leave_nothing_behind(smollm, prefiller) -> None:
    """24 requests from 4 threads, every third cancelled at a random moment: each gets exactly one
    final event, the others their full length, and every slot and key is free afterwards."""
    import random

    params = SamplingParams(max_tokens=5, ignore_eos=True)
    pre = prefiller.prefill("c", prompt(smollm.tokenizer, 6), params)
    cols: dict[str, Collector] = {}
    rng = random.Random(0)
    with DecodeEngine(smollm, num_slots=4, max_len=64, buckets=[64], max_queue=32) as eng:

        def client(t: int) -> None:
            for i in range(6):
                key = f"t{t}-{i}"
                req, cols[key] = request(key, pre, params)
                eng.submit(req)
                if i % 3 == 0:
                    threading.Event().wait(rng.random() * 0.05)
                    eng.cancel(key)

        threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for key, col in cols.items():
            col.wait()
            reason = col.final.finish_reason
            assert reason == "cancelled" or (reason == "length" and len(col.wait()) == 5), key
        stats = eng.stats()
        assert (stats["free_slots"], stats["queued"], stats["loading"]) == (4, 0, 0)
        assert not any(eng.cancel(key) for key in cols)  # no key is still known


def test_a_first_token_that_comes_with_the_kv_decodes_the_same(engine, prefiller, ragged) -> None:
    """The disaggregated path: decode learns the first token from the KV's handle, in load_kv."""
    ids, params, expected = ragged[5]
    pre = prefiller.prefill("late-first", ids, params)

    def load_kv(cache, slot) -> int:
        cache.load_all(slot, pre.kv)
        return pre.first_token

    col = Collector()
    engine.submit(DecodeRequest("late-first", pre.num_tokens, None, params, load_kv, col))
    assert col.wait() == expected
    assert engine.stats()["free_slots"] == 16


def test_a_cancel_that_overtakes_its_request_refuses_it_later(engine, prefiller, ragged) -> None:
    from rngd_pd.errors import RequestCancelled

    ids, params, _ = ragged[0]
    assert engine.cancel("early") is False  # not submitted yet: remembered
    assert engine.is_cancelled("early")
    req, col = request("early", prefiller.prefill("early", ids, params), params)
    with pytest.raises(RequestCancelled):
        engine.submit(req)
    assert not col.events and not engine.is_cancelled("early")


def test_phases_only_move_forward(smollm) -> None:
    from rngd_pd.engine.decode import Phase, _Entry

    entry = _Entry(DecodeRequest("k", 3, None, GREEDY, None, None), None, None, 11)
    entry.advance(Phase.LOADING)
    entry.advance(Phase.DONE)
    with pytest.raises(AssertionError, match="DONE -> ACTIVE"):
        entry.advance(Phase.ACTIVE)
