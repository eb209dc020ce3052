"""The PD flow of one request, as a plain class a test drives without Triton.

    key -> start decode (key, prompt length, sampling)   ┐ together: decode pulls each layer's KV
        -> prefill (token ids, key) -> first token       ┘ while prefill still computes the next
        -> emit the first token at once, then decode's tokens, then the finish reason

`ModelClient` is how a model is reached: by BLS inside the same tritonserver or by tritonclient gRPC
in another one (`rngd_pd.stubs.clients`); this module does not care which. Every failure ends the
request with the error (its type kept across the hop) after telling decode to drop the key, which
frees its slot and releases the KV on the transport. Client cancellation reaches decode the same way:
Triton 2.51 cannot cancel a BLS stream from the caller, so pd sends decode a small cancel request.

Conditional disaggregation: a prompt of at most `local_prefill_tokens` tokens (decode's measured
length, asked for once with `describe`) goes to decode with its ids, and decode prefills it itself: no
prefill call, no hand-off; decode's stream then starts with the first token. By default (`when="busy"`)
only where it waits less: the prompt tokens this pd has in flight to the prefill model (sent, no
first token yet) outnumber those it has in flight to decode's local prefills, this prompt included.
An idle prefill instance serves a short prompt at the cost of a hand-off and leaves decode's cores to
the running streams; a busy one would make it queue; and with many short prompts at once the two
queues fill alike instead of decode taking them all (Dynamo's rule also weighs the prefill queue).
`when="always"` goes by length alone. A request whose prefill server llm-d named (`prefill_at`)
always hands off: the endpoint picker has decided.

Prompts handed off wait their turn in a `PrefillQueue` (rngd_pd.engine.prefill_queue): `prefill_slots`
at a time per prefill server, shortest remaining prefill first with aging. A prompt longer than
`prefill_chunk` goes in chunks: each earlier chunk is a `cache_only` request that computes its KV into
prefill's prefix cache, a turn of its own, and the last request computes only the last chunk and hands
the whole KV over (a prefill server without a prefix cache answers 0 cached tokens: its prompts go
whole from then on). Decode's stream starts with the last turn, so a prompt waiting in the queue holds
no decode slot.

Each emitted `Chunk` (`rngd_pd.engine.chunks`) carries up to `CONTEXT` ids that precede its tokens,
so a stateless postprocess can detokenize streaming-safely (see `rngd_pd.stubs.text_models.text_delta`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from rngd_pd import errors
from rngd_pd.engine.chunks import Chunk, ChunkEmitter, context_len
from rngd_pd.engine.prefill_queue import PrefillQueue
from rngd_pd.engine.workers import RequestPool
from rngd_pd.model.sampling import FinishReason, SamplingParams, TokenLogprobs
from rngd_pd.wire import logprobs as lp
from rngd_pd.wire import tensors as T
from rngd_pd.wire.inputs import bytes_scalar, new_key, sampling_inputs

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting orchestrator looks at the client's cancel flag
# The most the failed or cancelled request waits for decode's stream to end after pd told decode to
# drop it (decode ends it at once, with finish_reason "cancelled"; a decode that does not answer must
# not hold the request).
JOIN_S = 2.0
CHOSEN_CLIENTS = 16  # gRPC clients to prefill servers named per request, kept open (most recent)
ASK_AGAIN_S = 30.0  # a decode that did not say its local prefill length is asked again after this
AUTO = -1  # local_prefill_tokens: ask decode
LOCAL_WHEN = ("busy", "always")  # local prefill where its queue is shorter, or by length alone


class ModelClient(Protocol):
    """Reaches one Triton model. Errors come back as `rngd_pd.errors` types (see errors.from_wire)."""

    def infer(self, model: str, inputs: Mapping[str, np.ndarray],
              outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        """One request, one response (blocking)."""
        ...

    def stream(self, model: str, inputs: Mapping[str, np.ndarray],
               outputs: tuple[str, ...]) -> Iterator[dict[str, np.ndarray]]:
        """A decoupled model's responses in order; raises the first error response. May block until
        the first response (BLS does), so call it from its own thread."""
        ...


@dataclass
class RunStats:
    """Timings of one request (seconds, monotonic), for metrics and the bench."""

    key: str
    start: float
    first_token_at: float = 0.0
    end: float = 0.0
    tokens: int = 0
    finish_reason: str = ""
    local_prefill: bool = False  # prefilled by decode itself (no hand-off)
    prompt_len: int = 0
    queued: bool = True  # its prompt still counts in a prefill queue (Orchestrator._prefill_here)
    extra: dict = field(default_factory=dict)


def _drain(responses: queue.SimpleQueue) -> list:
    """What decode has already sent, without waiting."""
    items = []
    while True:
        try:
            items.append(responses.get_nowait())
        except queue.Empty:
            return items


def _raise_refusal(ready: list) -> None:
    """Raise decode's error if it is among `ready`, taking it out of the list (`_run`'s frame holds
    `ready` and is in the error's traceback: a cycle, see rngd_pd.errors)."""
    errs = [i for i, (kind, _) in enumerate(ready) if kind == "err"]
    if errs:
        exc = ready.pop(errs[0])[1]
        try:
            raise exc
        finally:
            del exc  # a handed-over exception (rngd_pd.errors): no frame may keep it


PREFILL_OUTPUTS = (T.FIRST_TOKEN, T.FIRST_TOKENS, T.TOKEN_LOGPROB_IDS, T.TOKEN_LOGPROBS, T.PROMPT_LOGPROB_IDS,
                   T.PROMPT_LOGPROB_VALUES)
DECODE_OUTPUTS = (T.OUTPUT_IDS, T.FINISH_REASON, T.INDEX, T.TOKEN_LOGPROB_IDS, T.TOKEN_LOGPROBS)


def _ints(outputs: Mapping[str, np.ndarray], name: str) -> list[int]:
    array = outputs.get(name)
    return [] if array is None else [int(i) for i in array.reshape(-1)]


def _floats(outputs: Mapping[str, np.ndarray], name: str) -> list[float]:
    array = outputs.get(name)
    return [] if array is None else [float(v) for v in array.reshape(-1)]


def _close(client: ModelClient) -> None:
    """Close a client that has a close() (gRPC ones do; BLS ones hold nothing)."""
    close = getattr(client, "close", None)
    if close is not None:
        close()


class Orchestrator:
    """Runs requests through prefill and decode models reached by two `ModelClient`s (thread-safe)."""

    def __init__(self, prefill: ModelClient, decode: ModelClient, *, prefill_model: str = "prefill",
                 decode_model: str = "decode", max_streams: int = 32,
                 local_prefill_tokens: int = AUTO, local_prefill_when: str = "busy",
                 connect: Callable[[str], ModelClient] | None = None, prefill_slots: int = 1,
                 prefill_chunk: int = 512, prefill_aging: float = 1000.0) -> None:
        """local_prefill_tokens: prompts up to this long are prefilled by decode (AUTO: decode's own
        measured length; 0: always hand off), when `local_prefill_when` (module docstring).
        connect: a client for a prefill server named by address (llm-d's endpoint picker); the
        stub passes its gRPC client, so this module needs no Triton.
        prefill_slots / prefill_aging: the PrefillQueue's (0 slots: no queue, Triton's order);
        prefill_chunk: longer prompts go in chunks of this many tokens (0: whole)."""
        if local_prefill_when not in LOCAL_WHEN:
            raise errors.ConfigError(f"local_prefill_when must be one of {', '.join(LOCAL_WHEN)}, "
                                     f"got {local_prefill_when!r}")
        self.prefill, self.decode, self._connect = prefill, decode, connect
        self._local_tokens = local_prefill_tokens
        self._local_when = local_prefill_when
        self._queued = {False: 0, True: 0}  # prompt tokens in flight, no first token yet: remote, local
        self._queue_lock = threading.Lock()
        self._asked_at = -ASK_AGAIN_S
        self._ask_lock = threading.Lock()
        self.prefill_model, self.decode_model = prefill_model, decode_model
        # decode's streams are read on a fixed pool, one thread per running request; `run` is called
        # by at most `max_streams` threads at once (pd's request pool), so a stream never waits here
        self._pumps = RequestPool("pd-decode-stream", max_streams, max_streams)
        self._chosen: OrderedDict[str, ModelClient] = OrderedDict()  # prefill servers llm-d named
        self._chosen_lock = threading.Lock()
        if prefill_chunk < 0:
            raise errors.ConfigError(f"prefill_chunk must be >= 0 (0: whole prompts), got {prefill_chunk}")
        self.prefill_queue = PrefillQueue(prefill_slots, prefill_aging)
        self._chunk = prefill_chunk
        self._whole: set[str] = set()  # prefill servers that keep no prefix cache: prompts go whole

    def close(self) -> None:
        """Stop reading decode streams (from the model's finalize)."""
        self._pumps.close()
        with self._chosen_lock:
            for client in self._chosen.values():
                _close(client)
            self._chosen.clear()

    def prefill_client(self, address: str | None) -> ModelClient:
        """The configured prefill client, or one for the server llm-d's endpoint picker chose
        (`host:port`, gRPC); the most recent CHOSEN_CLIENTS are kept open."""
        if not address:
            return self.prefill
        with self._chosen_lock:
            client = self._chosen.pop(address, None)
            if client is None:
                if self._connect is None:
                    raise errors.ConfigError(f"prefill server {address!r} was named, but this "
                                             "orchestrator reaches no server by address")
                client = self._connect(address)
            self._chosen[address] = client
            while len(self._chosen) > CHOSEN_CLIENTS:
                _close(self._chosen.popitem(last=False)[1])
            return client

    def local_prefill_tokens(self) -> int:
        """Up to which prompt length decode prefills itself: configured, or asked of decode once (a
        decode that does not answer: 0, hand off everything, and ask again in ASK_AGAIN_S)."""
        if self._local_tokens != AUTO:
            return self._local_tokens
        with self._ask_lock:
            if self._local_tokens != AUTO:
                return self._local_tokens
            if time.monotonic() - self._asked_at < ASK_AGAIN_S:
                return 0
            self._asked_at = time.monotonic()
            inputs = {T.REQUEST_KEY: np.array([b"describe"], dtype=np.object_), T.DESCRIBE: np.array([True])}
            try:
                answers = list(self.decode.stream(self.decode_model, inputs, (T.LOCAL_PREFILL_TOKENS,)))
                self._local_tokens = max(0, int(answers[-1][T.LOCAL_PREFILL_TOKENS].reshape(-1)[0]))
            except Exception as exc:
                log.warning("decode did not say its local prefill length (%s); handing off every prompt",
                            str(exc))
                return 0
            log.info("prompts up to %d tokens are prefilled by decode", self._local_tokens)
            return self._local_tokens

    def run(self, input_ids: list[int], params: SamplingParams, stream: bool,
            emit: Callable[[Chunk], None], cancelled: Callable[[], bool] = lambda: False,
            prefill_at: str | None = None) -> RunStats:
        """Generate for one request, calling `emit` per chunk; raises on failure or cancellation.
        `prefill_at`: the prefill server (gRPC host:port) to use for this request instead of the
        configured one (llm-d's `x-prefiller-host-port`)."""
        if not input_ids:
            raise errors.ConfigError("the prompt is empty: give at least one token id")
        stats = RunStats(new_key(), time.monotonic(), prompt_len=len(input_ids))
        # prompt logprobs come from the prefill model only (decode's local prefill does not send them)
        stats.local_prefill = self._prefill_here(len(input_ids), prefill_at or
                                                 params.prompt_logprobs is not None)
        try:
            self._run(input_ids, params, stream, emit, cancelled, prefill_at, stats)
        finally:
            self._dequeue(stats)
        return stats

    def _run(self, input_ids: list[int], params: SamplingParams, stream: bool,
             emit: Callable[[Chunk], None], cancelled: Callable[[], bool], prefill_at: str | None,
             stats: RunStats) -> None:
        responses: queue.SimpleQueue = queue.SimpleQueue()
        pumps: list = []

        def start_decode() -> None:
            pumps.append(self._pumps.submit(self._pump, stats.key, input_ids, params, responses,
                                            stats.local_prefill))

        out = ChunkEmitter(stream, emit, context_len(params.stop), params.n)
        try:
            ready: list = []
            if stats.local_prefill:
                start_decode()
            else:
                firsts, prompt = self._prefill_turns(prefill_at, stats, input_ids, params, cancelled,
                                                     start_decode)
                ready = _drain(responses)
                _raise_refusal(ready)  # decode refused it already (over the context limit, say): no token
                stats.first_token_at = time.monotonic()
                self._dequeue(stats)
                for i, (token, logprobs) in enumerate(firsts):
                    out.add([token], "", i, None if logprobs is None else [logprobs],
                            prompt if i == 0 else None)
            self._follow(stats.key, responses, out, cancelled, stats, ready)
        except BaseException as exc:
            if pumps:  # decode has the request (or will): drop it there
                self.abort(stats.key)
                pumps[0].wait(JOIN_S)
            if isinstance(exc, errors.RngdPdError) and exc.key is None:
                exc.key = stats.key
            raise
        stats.end, stats.tokens = time.monotonic(), len(out.ids)

    def _prefill_here(self, prompt_len: int, prefill_at: str | bool | None) -> bool:
        """Whether decode prefills this prompt itself (module docstring; never when `prefill_at` is
        set); counts the prompt's tokens in the queue it joins until its first token (`_dequeue`)."""
        local = (not prefill_at and prompt_len <= self.local_prefill_tokens())
        with self._queue_lock:
            if local and self._local_when == "busy":
                local = self._queued[True] + prompt_len <= self._queued[False]
            self._queued[local] += prompt_len
        return local

    def queued_tokens(self) -> tuple[int, int]:
        """Prompt tokens in flight without a first token yet: (to prefill, to decode's local prefill)."""
        with self._queue_lock:
            return self._queued[False], self._queued[True]

    def _dequeue(self, stats: RunStats) -> None:
        """The request's prompt left its prefill queue (first token, or the request ended); once."""
        with self._queue_lock:
            if stats.queued:
                self._queued[stats.local_prefill] -= stats.prompt_len
                stats.queued = False

    def _prefill_turns(self, prefill_at: str | None, stats: RunStats, input_ids: list[int],
                       params: SamplingParams, cancelled: Callable[[], bool], start_decode: Callable[[], None]
                       ) -> tuple[list[tuple[int, TokenLogprobs | None]], list[TokenLogprobs] | None]:
        """Prefill by the prefill model, in turns of the PrefillQueue (module docstring): the earlier
        chunks into its prefix cache, then the rest with the hand-off, decode's stream started just
        before it."""
        client, server = self.prefill_client(prefill_at), prefill_at or ""
        # prompt logprobs need every position's logits, which the prefix cache does not keep
        chunk = self._chunk if params.prompt_logprobs is None and server not in self._whole else 0
        done, total = 0, len(input_ids)
        while chunk and total - done > chunk:
            with self.prefill_queue.turn(server, total - done, stats.start, cancelled):
                cached = self._cache_chunk(client, stats.key, input_ids[:done + chunk])
            if cached <= done:  # no prefix cache there (or it evicted the chunk at once): send it whole
                if not cached:
                    self._whole.add(server)
                    log.warning("prefill server %s keeps no prefix cache: its prompts go whole, not in "
                                "chunks of %d tokens (set prefix_cache_mb > 0 there, or prefill_chunk=0 "
                                "here)", server or "(local)", chunk)
                break
            done = cached
        with self.prefill_queue.turn(server, total - done, stats.start, cancelled):
            start_decode()
            return self._prefill(client, stats.key, input_ids, params)

    def _cache_chunk(self, client: ModelClient, key: str, head: list[int]) -> int:
        """Have prefill compute `head`'s KV into its prefix cache; the tokens of it cached there."""
        inputs = {T.REQUEST_KEY: np.array([key.encode()], dtype=np.object_),
                  T.INPUT_IDS: np.asarray(head, dtype=np.int32), T.CACHE_ONLY: np.array([True])}
        result = client.infer(self.prefill_model, inputs, (T.CACHED_TOKENS,))
        return (_ints(result, T.CACHED_TOKENS) or [0])[0]

    def _prefill(self, client: ModelClient, key: str, input_ids: list[int], params: SamplingParams
                 ) -> tuple[list[tuple[int, TokenLogprobs | None]], list[TokenLogprobs] | None]:
        """Prefill by the prefill model: each choice's first token (with its logprobs when asked
        for), and the prompt's logprobs when asked for."""
        inputs = {T.REQUEST_KEY: np.array([key.encode()], dtype=np.object_),
                  T.INPUT_IDS: np.asarray(input_ids, dtype=np.int32),
                  **sampling_inputs(params, with_max_tokens=False)}
        inputs.pop(T.STOP, None)  # prefill samples one token; stop strings are decode's business
        result = client.infer(self.prefill_model, inputs, PREFILL_OUTPUTS)
        tokens = _ints(result, T.FIRST_TOKENS) or _ints(result, T.FIRST_TOKEN)[:1]
        if len(tokens) != params.n:
            raise errors.RngdPdError(f"prefill sampled {len(tokens)} first tokens for n={params.n}", key=key)
        firsts = lp.unflatten(_ints(result, T.TOKEN_LOGPROB_IDS), _floats(result, T.TOKEN_LOGPROBS),
                              len(tokens))
        prompt = lp.unflatten(_ints(result, T.PROMPT_LOGPROB_IDS), _floats(result, T.PROMPT_LOGPROB_VALUES),
                              len(input_ids) - 1)
        return [(t, None if firsts is None else firsts[i]) for i, t in enumerate(tokens)], prompt

    def _pump(self, key: str, input_ids: list[int], params: SamplingParams, responses: queue.SimpleQueue,
              local: bool = False) -> None:
        """Decode's responses into the queue: ("out", outputs) ..., then ("end", None) or ("err", exc).
        `local`: decode prefills the prompt itself; else it gets the prompt's length (and its ids when
        the repetition penalty needs them)."""
        inputs = {T.REQUEST_KEY: np.array([key.encode()], dtype=np.object_),
                  T.PROMPT_LEN: np.array([len(input_ids)], np.int32), **sampling_inputs(params)}
        if local:
            inputs[T.INPUT_IDS] = np.asarray(input_ids, dtype=np.int32)
        elif params.repetition_penalty != 1:
            inputs[T.PROMPT_IDS] = np.asarray(input_ids, dtype=np.int32)
        try:
            for outputs in self.decode.stream(self.decode_model, inputs, DECODE_OUTPUTS):
                responses.put(("out", outputs))
            responses.put(("end", None))
        except BaseException as exc:  # delivered to the request's thread, which raises it
            responses.put(("err", exc))

    def _follow(self, key: str, responses: queue.SimpleQueue, out: ChunkEmitter,
                cancelled: Callable[[], bool], stats: RunStats, ready: list) -> None:
        """Forward decode's tokens (`ready` ones first) until its finish reason; check for client
        cancellation meanwhile."""
        while True:
            if cancelled():
                raise errors.RequestCancelled("the client cancelled the request", key=key)
            if ready:
                kind, value = ready.pop(0)
            else:
                try:
                    kind, value = responses.get(timeout=POLL_S)
                except queue.Empty:
                    continue
            if kind == "err":
                try:
                    raise value
                finally:
                    del value  # a handed-over exception (rngd_pd.errors): no frame may keep it
            if kind == "end":
                raise errors.RngdPdError("decode ended its stream without a finish reason", key=key)
            ids = _ints(value, T.OUTPUT_IDS)
            reasons = value.get(T.FINISH_REASON)
            reason = bytes_scalar(reasons.reshape(-1)[0]) if reasons is not None and reasons.size else ""
            if reason == FinishReason.CANCELLED:
                raise errors.RequestCancelled("decode cancelled the request", key=key)
            if reason == FinishReason.ERROR:
                raise errors.RngdPdError("decode ended the request: error", key=key)
            if ids and not stats.first_token_at:  # decode prefilled it: its first token is the first
                stats.first_token_at = time.monotonic()
                self._dequeue(stats)
            index = (_ints(value, T.INDEX) or [0])[0]
            logprobs = lp.unflatten(_ints(value, T.TOKEN_LOGPROB_IDS), _floats(value, T.TOKEN_LOGPROBS),
                                    len(ids))
            out.add(ids, reason, index, logprobs)
            if reason:
                stats.finish_reason = reason
            if out.done:
                return

    def abort(self, key: str) -> None:
        """Tell decode to drop `key`: frees its slot and releases the KV (idempotent, never raises)."""
        inputs = {T.REQUEST_KEY: np.array([key.encode()], dtype=np.object_), T.CANCEL: np.array([True])}
        try:
            for _ in self.decode.stream(self.decode_model, inputs, (T.FINISH_REASON,)):
                pass
        except Exception as exc:  # the request already failed; this is cleanup
            log.warning("cancelling decode of request %s failed: %s", key, str(exc))
