"""The PD flow (rngd_pd.engine.orchestrator) driven without Triton, through a fake ModelClient.

The fake stands in for Triton's model calls only (the layer below the orchestrator); the real models
are exercised by the e2e tests. Also: error types survive a hop, and streamed text is UTF-8 safe.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator, Mapping

import numpy as np
import pytest

from rngd_pd import errors
from rngd_pd.engine.chunks import CONTEXT, Chunk
from rngd_pd.engine.orchestrator import Orchestrator, RunStats
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.wire import tensors as T
from rngd_pd.wire.inputs import sampling_inputs, sampling_params


class FakeModels:
    """prefill returns `first`; decode streams `tokens` once prefill ran (as if waiting for the KV)."""

    def __init__(self, first: int = 7, tokens: tuple[int, ...] = (8, 9, 10), reason: str = "length",
                 prefill_error: Exception | None = None, decode_error: Exception | None = None,
                 hold: threading.Event | None = None, local_tokens: int | None = 0) -> None:
        self.first, self.tokens, self.reason = first, tokens, reason
        self.local_tokens = local_tokens  # what decode answers to `describe` (None: it fails)
        self.described = 0
        self.prefill_error, self.decode_error, self.hold = prefill_error, decode_error, hold
        self.prefilled = threading.Event()
        self.calls: list[tuple[str, dict]] = []
        self.aborted: list[str] = []

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: tuple[str, ...]) -> dict:
        self.calls.append((model, dict(inputs)))
        if self.prefill_error is not None:
            raise copy.copy(self.prefill_error)  # a fresh one, as a real hop makes
        self.prefilled.set()
        return {T.FIRST_TOKEN: np.array([self.first], np.int32)}

    def stream(self, model: str, inputs: Mapping[str, np.ndarray],
               outputs: tuple[str, ...]) -> Iterator[dict]:
        key = inputs[T.REQUEST_KEY][0].decode()
        if T.CANCEL in inputs:
            self.aborted.append(key)
            yield {T.FINISH_REASON: np.array([b"cancelled"], dtype=np.object_)}
            return
        if T.DESCRIBE in inputs:
            self.described += 1
            if self.local_tokens is None:
                raise errors.ConfigError("unknown input 'describe'")
            yield {T.LOCAL_PREFILL_TOKENS: np.array([self.local_tokens], np.int32)}
            return
        self.calls.append((model, dict(inputs)))
        if T.INPUT_IDS in inputs:  # decode prefills it: its stream starts with the first token
            yield {T.OUTPUT_IDS: np.array([self.first], np.int32),
                   T.FINISH_REASON: np.array([b""], dtype=np.object_)}
        else:
            self.prefilled.wait(5)
        if self.decode_error is not None:
            raise copy.copy(self.decode_error)
        for i, tok in enumerate(self.tokens):
            if self.hold is not None and i == 1:
                self.hold.wait(5)
            last = i == len(self.tokens) - 1
            yield {T.OUTPUT_IDS: np.array([tok], np.int32),
                   T.FINISH_REASON: np.array([self.reason.encode() if last else b""], dtype=np.object_)}


def _run(models: FakeModels, stream: bool = True, **kw) -> tuple[list[Chunk], object]:
    chunks: list[Chunk] = []
    params = SamplingParams(max_tokens=4)
    stats = Orchestrator(models, models, local_prefill_when="always").run([1, 2, 3], params, stream,
                                                                          chunks.append, **kw)
    return chunks, stats


def test_streams_the_first_token_from_prefill_then_decodes_tokens() -> None:
    models = FakeModels()
    chunks, stats = _run(models)
    assert [c.token_ids for c in chunks] == [[7], [8], [9], [10]]
    assert [c.finish_reason for c in chunks] == ["", "", "", "length"]
    assert chunks[3].context_ids == [7, 8, 9]
    assert stats.tokens == 4 and stats.first_token_at >= stats.start
    (decode_call,) = [c for m, c in models.calls if m == "decode"]
    assert int(decode_call[T.PROMPT_LEN][0]) == 3 and int(decode_call[T.MAX_TOKENS][0]) == 4
    assert models.aborted == []


def test_a_short_prompt_is_prefilled_by_decode_without_a_prefill_call() -> None:
    models = FakeModels(local_tokens=3)
    chunks, stats = _run(models)
    assert [c.token_ids for c in chunks] == [[7], [8], [9], [10]] and stats.local_prefill
    assert [m for m, _ in models.calls] == ["decode"]
    (decode_call,) = [c for _, c in models.calls]
    assert decode_call[T.INPUT_IDS].tolist() == [1, 2, 3] and stats.first_token_at >= stats.start
    models = FakeModels(local_tokens=2)  # the prompt is longer: handed off
    chunks, stats = _run(models)
    assert [m for m, _ in models.calls] == ["prefill", "decode"] and not stats.local_prefill
    assert T.INPUT_IDS not in models.calls[1][1]


def test_the_local_prefill_length_is_asked_once_and_can_be_turned_off() -> None:
    models = FakeModels(local_tokens=100)
    orch = Orchestrator(models, models, local_prefill_when="always")
    for _ in range(3):
        assert orch.run([1, 2], SamplingParams(max_tokens=4), True, lambda c: None).local_prefill
    assert models.described == 1
    silent = FakeModels(local_tokens=None)  # an older decode: everything is handed off, asked again later
    orch = Orchestrator(silent, silent)
    assert not orch.run([1, 2], SamplingParams(max_tokens=4), True, lambda c: None).local_prefill
    assert not orch.run([1, 2], SamplingParams(max_tokens=4), True, lambda c: None).local_prefill
    assert silent.described == 1
    off = FakeModels(local_tokens=100)
    assert not Orchestrator(off, off, local_prefill_tokens=0).run(
        [1], SamplingParams(max_tokens=4), True, lambda c: None).local_prefill
    assert off.described == 0


def test_by_default_a_short_prompt_is_prefilled_locally_only_where_it_waits_less() -> None:
    release = threading.Event()

    class SlowPrefill(FakeModels):
        def infer(self, model, inputs, outputs):
            if len(inputs[T.INPUT_IDS]) > 5:  # the long prompt's prefill takes a while
                release.wait(10)
            return super().infer(model, inputs, outputs)

    models = SlowPrefill(local_tokens=5)
    orch = Orchestrator(models, models)
    params = SamplingParams(max_tokens=4)
    assert not orch.run([1, 2], params, True, lambda c: None).local_prefill  # prefill idle: hand off
    long = threading.Thread(target=orch.run, args=(list(range(1, 20)), params, True, lambda c: None))
    long.start()
    deadline = time.monotonic() + 10
    while orch.queued_tokens() != (19, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert orch.run([1, 2], params, True, lambda c: None).local_prefill  # it would queue: decode does it
    assert orch.queued_tokens() == (19, 0)  # a finished request leaves its queue
    release.set()
    long.join(10)
    assert orch.queued_tokens() == (0, 0)
    assert not orch.run([1, 2], params, True, lambda c: None).local_prefill


def test_short_prompts_fill_both_queues_instead_of_all_going_to_decode() -> None:
    """Many short prompts at once while one 4-token prefill runs: decode takes those that fit
    under the prefill queue's tokens, the rest queue for prefill (no all-local pile-up on decode)."""
    release, local_started = threading.Event(), threading.Event()

    class Held(FakeModels):
        def infer(self, model, inputs, outputs):
            release.wait(10)
            return super().infer(model, inputs, outputs)

        def stream(self, model, inputs, outputs):
            if T.INPUT_IDS in inputs:  # a local prefill: hold it until released
                local_started.set()
                release.wait(10)
            yield from super().stream(model, inputs, outputs)

    models = Held(local_tokens=5)
    orch = Orchestrator(models, models)
    params = SamplingParams(max_tokens=2)
    runs: list[RunStats] = []

    def run(ids: list[int]) -> None:
        runs.append(orch.run(ids, params, True, lambda c: None))

    threads = [threading.Thread(target=run, args=(ids,)) for ids in ([1, 2, 3, 4], [5, 6], [7, 8], [9, 10])]
    threads[0].start()
    deadline = time.monotonic() + 10
    while orch.queued_tokens() != (4, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
    while sum(orch.queued_tokens()) != 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert orch.queued_tokens() == (6, 4)  # two 2-token prompts fit under 4 queued tokens; one did not
    release.set()
    for t in threads:
        t.join(10)
    assert sorted(r.local_prefill for r in runs) == [False, False, True, True]
    assert orch.queued_tokens() == (0, 0)
    with pytest.raises(errors.ConfigError, match="local_prefill_when"):
        Orchestrator(models, models, local_prefill_when="sometimes")


def test_context_ids_are_capped() -> None:
    chunks, _ = _run(FakeModels(tokens=tuple(range(20, 40))))
    assert chunks[-1].context_ids == list(range(40 - CONTEXT - 1, 39))


def test_without_stream_one_final_chunk_holds_everything() -> None:
    chunks, _ = _run(FakeModels(), stream=False)
    assert chunks == [Chunk([7, 8, 9, 10], [], "length")]


def test_prefill_failure_fails_the_request_and_drops_decode() -> None:
    models = FakeModels(prefill_error=errors.TransportError("KV transport 'tcp' failed to push blob 0"))
    with pytest.raises(errors.TransportError, match="tcp") as info:
        _run(models)
    assert info.value.key is not None and models.aborted == [info.value.key]


def test_decode_failure_fails_the_request_after_the_first_token() -> None:
    models = FakeModels(decode_error=errors.TransportIntegrityError("KV transport 'shm': crc32c mismatch"))
    chunks: list[Chunk] = []
    with pytest.raises(errors.TransportIntegrityError, match="shm"):
        Orchestrator(models, models).run([1], SamplingParams(), True, chunks.append)
    assert [c.token_ids for c in chunks] == [[7]] and len(models.aborted) == 1


class RefusingDecode(FakeModels):
    """decode rejects the request at once (context limit) while prefill still runs."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = threading.Event()

    def infer(self, model, inputs, outputs):
        self.refused.wait(5)
        time.sleep(0.05)  # the pump has queued decode's error by now
        return super().infer(model, inputs, outputs)

    def stream(self, model, inputs, outputs):
        if T.CANCEL in inputs:
            yield from super().stream(model, inputs, outputs)
            return
        self.refused.set()
        raise errors.ContextLengthError("prompt of 3 tokens + max_tokens 9000 exceeds 2048")
        yield  # a generator, like the real stream


def test_a_request_decode_already_refused_fails_without_a_first_token() -> None:
    """No token goes out before the error (inside the llm ensemble a token in flight in postprocess
    next to pd's error left the ensemble request open)."""
    models = RefusingDecode()
    chunks: list[Chunk] = []
    with pytest.raises(errors.ContextLengthError):
        Orchestrator(models, models).run([1, 2, 3], SamplingParams(), True, chunks.append)
    assert chunks == [] and len(models.aborted) == 1


class _Sink(list):
    """The request's emit target; weakly referenceable, unlike a plain list."""


@pytest.mark.parametrize("models, raises", [
    (RefusingDecode, errors.ContextLengthError),  # decode's error seen before the first token
    (lambda: FakeModels(decode_error=errors.TransportError("KV transport 'tcp' lost the relay")),
     errors.TransportError),  # decode's error while following its stream
    (lambda: FakeModels(prefill_error=errors.CapacityError("prefill queue full")), errors.CapacityError),
])
def test_a_failed_request_leaves_no_reference_cycle(models, raises) -> None:
    """Everything a failed request held is freed by reference counting alone: a cycle through its
    error's traceback kept pd's Triton request alive in an idle stub, and Triton then never unloaded
    pd (the exit timeout ran out at shutdown)."""
    import gc
    import weakref

    orchestrator, sink = Orchestrator(m := models(), m), _Sink()
    alive = weakref.ref(sink)
    gc.collect()
    gc.disable()
    try:
        try:
            orchestrator.run([1, 2, 3], SamplingParams(), True, sink.append)
        except raises:
            pass
        del sink
        deadline = time.monotonic() + 5
        while alive() is not None and time.monotonic() < deadline:  # the pump thread lets go last
            time.sleep(0.01)
        assert alive() is None, [type(r).__name__ for r in gc.get_referrers(alive())]
    finally:
        gc.enable()


def test_client_cancel_stops_and_tells_decode() -> None:
    hold = threading.Event()
    models = FakeModels(tokens=(8, 9, 10, 11), hold=hold)
    chunks: list[Chunk] = []
    with pytest.raises(errors.RequestCancelled):
        Orchestrator(models, models).run([1], SamplingParams(max_tokens=9), True, chunks.append,
                                         cancelled=lambda: len(chunks) >= 2)
    hold.set()
    assert len(models.aborted) == 1 and [c.token_ids for c in chunks] == [[7], [8]]


def test_decode_ending_a_request_as_cancelled_is_a_cancellation() -> None:
    """decode ends a cancelled request with finish_reason "cancelled" (not an error response)."""
    chunks: list[Chunk] = []
    with pytest.raises(errors.RequestCancelled, match="decode cancelled"):
        Orchestrator(*[FakeModels(tokens=(8,), reason="cancelled")] * 2).run(
            [1], SamplingParams(), True, chunks.append)
    assert [c.token_ids for c in chunks] == [[7]]


def test_empty_prompt_and_bad_params_fail_before_any_call() -> None:
    models = FakeModels()
    with pytest.raises(errors.ConfigError):
        Orchestrator(models, models).run([], SamplingParams(), True, lambda c: None)
    with pytest.raises(errors.ConfigError):
        Orchestrator(models, models).run([1], SamplingParams(temperature=-1.0), True, lambda c: None)
    assert models.calls == []


def test_error_types_survive_a_hop_through_triton() -> None:
    sent = errors.TransportTimeoutError("KV transport 'tcp': blob 3 did not arrive", key="k1")
    err = errors.from_wire(errors.to_wire(sent))
    assert type(err) is errors.TransportTimeoutError and err.key == "k1" and err.message == sent.message
    err.key = "k1"  # pd names the request again: the text still says it once
    assert str(err).count("[request k1]") == 1
    assert errors.from_wire(errors.to_wire(err)).key == "k1"  # a second hop keeps it too
    wrapped = errors.from_wire("in ensemble 'llm', ContextLengthError: [request k2] too long")
    assert type(wrapped) is errors.ContextLengthError
    assert (wrapped.key, wrapped.message) == ("k2", "too long")
    assert type(errors.from_wire("something else")) is errors.RngdPdError
    assert type(errors.from_wire("ValueError: not ours")) is errors.RngdPdError
    plain = errors.from_wire(errors.to_wire(ValueError("bad")))
    assert type(plain) is errors.RngdPdError and "bad" in str(plain)


def test_sampling_params_round_trip_through_tensors() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.5, top_p=0.75, top_k=40, seed=3, stop=("\n\n",))
    tensors = sampling_inputs(params)
    assert sampling_params(tensors.get) == params
    with pytest.raises(errors.ConfigError, match="max_tokens"):
        sampling_params({}.get)


class ChunkingPrefill(FakeModels):
    """A prefill with a prefix cache of `cache` (False: none, it answers 0 cached tokens)."""

    def __init__(self, cache: bool = True) -> None:
        super().__init__()
        self.cache = cache
        self.cached_heads: list[int] = []

    def infer(self, model, inputs, outputs):
        if T.CACHE_ONLY in inputs:
            self.calls.append((model, dict(inputs)))
            head = len(inputs[T.INPUT_IDS])
            self.cached_heads.append(head)
            return {T.CACHED_TOKENS: np.array([head if self.cache else 0], np.int32)}
        return super().infer(model, inputs, outputs)


def _kinds(models: FakeModels) -> list[str]:
    return [("cache" if T.CACHE_ONLY in c else m) for m, c in models.calls]


def test_a_long_prompt_is_prefilled_in_cached_chunks_then_handed_off_whole() -> None:
    """1,300 tokens in chunks of 512: two cache_only requests (heads of 512 and 1,024 tokens), then
    the whole prompt; decode's stream starts only with that last turn, and tokens are unchanged."""
    models = ChunkingPrefill()
    orch = Orchestrator(models, models, local_prefill_tokens=0, prefill_chunk=512)
    chunks: list[Chunk] = []
    orch.run(list(range(1, 1301)), SamplingParams(max_tokens=4), True, chunks.append)
    assert models.cached_heads == [512, 1024]
    assert _kinds(models) == ["cache", "cache", "prefill", "decode"]
    assert [c.token_ids for c in chunks] == [[7], [8], [9], [10]]
    assert orch.prefill_queue.depth() == {}
    models = ChunkingPrefill()  # prompt logprobs need every position: the prompt goes whole
    Orchestrator(models, models, local_prefill_tokens=0).run(
        list(range(1, 1301)), SamplingParams(max_tokens=4, prompt_logprobs=1), True, lambda c: None)
    assert models.cached_heads == []


def test_a_prefill_without_a_prefix_cache_gets_whole_prompts_from_then_on() -> None:
    models = ChunkingPrefill(cache=False)
    orch = Orchestrator(models, models, local_prefill_tokens=0, prefill_chunk=512)
    for _ in range(2):
        orch.run(list(range(1, 1301)), SamplingParams(max_tokens=4), True, lambda c: None)
    assert models.cached_heads == [512]  # asked once; its 0 cached tokens said "no cache"
    assert _kinds(models) == ["cache", "prefill", "decode", "prefill", "decode"]
    models = ChunkingPrefill()
    Orchestrator(models, models, local_prefill_tokens=0, prefill_chunk=0).run(
        list(range(1, 1301)), SamplingParams(max_tokens=4), True, lambda c: None)
    assert models.cached_heads == []
    with pytest.raises(errors.ConfigError, match="prefill_chunk"):
        Orchestrator(models, models, prefill_chunk=-1)


def test_a_request_cancelled_while_its_prompt_waits_for_prefill_never_reaches_decode() -> None:
    release = threading.Event()

    class Busy(FakeModels):
        def infer(self, model, inputs, outputs):
            release.wait(10)
            return super().infer(model, inputs, outputs)

    models = Busy()
    orch = Orchestrator(models, models, local_prefill_tokens=0)
    first = threading.Thread(target=orch.run, args=([1, 2, 3], SamplingParams(max_tokens=4), True,
                                                    lambda c: None))
    first.start()
    deadline = time.monotonic() + 10
    while orch.prefill_queue.depth().get("", (0, 0))[0] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(errors.RequestCancelled, match="waited for prefill"):
        orch.run([4, 5], SamplingParams(max_tokens=4), True, lambda c: None, cancelled=lambda: True)
    release.set()
    first.join(10)
    assert [m for m, _ in models.calls] == ["decode", "prefill"] or \
        [m for m, _ in models.calls] == ["prefill", "decode"]
    assert models.aborted == [] and orch.prefill_queue.depth() == {}
