"""The `decode` model (decoupled): request key + prompt length + sampling -> a stream of tokens.

It is started together with prefill and waits in the engine for a slot; then one of the engine's
loader threads pulls each layer's KV into that slot as prefill pushes it (the transfer overlaps
prefill), then the handle with the first token, validates all of it and releases the key on the
transport. The stream carries the tokens after the first one (pd already has the first from prefill)
and ends with the finish reason. It never recomputes the prompt.

A request that brings its `input_ids` is prefilled here instead (conditional disaggregation: pd sends
prompts up to `local_prefill_tokens` long this way, which it learns once with `describe=true`); its
stream then starts with the first token. rngd_pd.engine.local_prefill says how the length is measured.

A request with `cancel=true` stops the key instead: the engine frees the slot, a KV wait is abandoned,
the KV is released; keys cancelled before their start request arrives are remembered for a while.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rngd_pd import errors
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.capacity import decode_slots
from rngd_pd.engine.decode import DecodeEngine
from rngd_pd.engine.local_prefill import Threshold, measure
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.request import DecodeRequest, TokenEvent
from rngd_pd.kv.handle import KVSpec
from rngd_pd.kv.handoff import KVReceiver
from rngd_pd.model.params import FinishReason, TokenLogprobs
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.stubs import pbutils
from rngd_pd.stubs.loading import load_for
from rngd_pd.stubs.metrics import Load, load_gauges, triton_metrics
from rngd_pd.stubs.sending import ResponseLoop
from rngd_pd.stubs.serving import DecodeParams, getter, transport_for, transport_params
from rngd_pd.stubs.weights import WeightsControl
from rngd_pd.wire import inputs, logprobs
from rngd_pd.wire import tensors as T


@dataclass(frozen=True)
class Out:
    """One response of decode: a choice's new ids (with their logprobs when asked for), its finish
    reason on its last, an error; `final` once every choice of the request has ended."""

    ids: list[int]
    reason: str = ""
    error: BaseException | None = None
    index: int = 0
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    final: bool = False


Emit = Callable[[Out], None]
IN_FLIGHT = "airm_decode_requests_in_flight"


class DecodeService:
    """DecodeEngine + transport; thread-safe. `emit` gets (ids, finish_reason, error).

    A started request waits in the engine for a slot; once it has one, one of the engine's loader
    threads (as many as slots, a fixed pool) pulls its KV straight into that slot as prefill pushes
    it, validates it, releases the key on the transport and hands the first token to the engine.
    The engine's record of the request is the only one (`rngd_pd.engine.decode.Phase`).
    """

    def __init__(self, loaded: Any, transport: Any, kv_dtype: str = "bf16", num_slots: int = 8,
                 max_len: int = 4096, max_queue: int = 64, kv_timeout_s: float = 60.0,
                 on_kv: Callable[[float], None] | None = None, local_prefill_tokens: int = 0,
                 step_target_ms: float = 100.0, kv_cache_mb: int = 0) -> None:
        """local_prefill_tokens: the prompt length up to which pd should send prompts here to be
        prefilled locally (-1: measure it now, rngd_pd.engine.local_prefill; 0: never). num_slots 0:
        sized now from the step time and the memory (rngd_pd.engine.capacity)."""

        runtime = as_runtime(loaded)  # loading.load_for's DeviceRuntime, or a LoadedModel for the CPU
        loaded = runtime.loaded
        c = loaded.config
        self.loaded, self.transport = loaded, transport
        spec = KVSpec(loaded.fingerprint, c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
        self.receiver = KVReceiver(transport, spec, timeout_s=kv_timeout_s)
        self.capacity = decode_slots(runtime, num_slots, max_len, kv_dtype, step_target_ms, kv_cache_mb)
        num_slots = self.capacity.slots
        self.engine = DecodeEngine(runtime, num_slots, max_len, kv_dtype, max_queue,
                                   loader_threads=num_slots)
        self._local_lock = threading.Lock()  # one local prefill at a time: they share the cores
        self.local: PrefillEngine | None = None
        try:
            self.local = PrefillEngine(runtime, kv_dtype, chunk_size=512, max_context=self.engine.max_len)
            self.threshold = (measure(self.local, self.engine) if local_prefill_tokens < 0 else
                              Threshold(local_prefill_tokens, "set by local_prefill_tokens"))
        except errors.DeviceUnavailableError as exc:  # a decode-only device (ATOM): always hand off
            self.local, self.threshold = None, Threshold(0, f"this device cannot prefill: {exc.message}")
        self.engine.start()
        self.on_kv = on_kv  # gets each request's KV wait + transfer seconds (metrics)

    def start(self, key: str, prompt_len: int, params: SamplingParams, emit: Emit,
              token_ids: list[int] | None = None, prompt_ids: Sequence[int] = ()) -> None:
        """Begin one request (with `token_ids`: prefill it here; `prompt_ids`: the prompt for the
        repetition penalty of a handed-off one); raises ConfigError / ContextLengthError /
        CapacityError / RequestCancelled before anything runs."""
        if token_ids is not None:
            if self.local is None:
                raise errors.ConfigError(f"this decode instance cannot prefill ({self.threshold.reason}); "
                                         f"send {T.PROMPT_LEN!r} and hand the KV off", key=key)
            self.local.validate(key, token_ids, params)
            request = DecodeRequest(key, len(token_ids), None, params,
                                    self._local_loader(key, token_ids, params),
                                    self._forward(key, params.n, emit, with_first=True), prompt_ids=token_ids)
        else:
            if params.repetition_penalty != 1 and len(prompt_ids) != prompt_len:
                raise errors.ConfigError(f"the repetition penalty needs the prompt: send its {prompt_len} "
                                         f"ids as {T.PROMPT_IDS!r}", key=key)
            request = DecodeRequest(key, prompt_len, None, params, self._loader(key, prompt_len),
                                    self._forward(key, params.n, emit), prompt_ids=prompt_ids)
        try:
            self.engine.submit(request)
        except BaseException:
            self._release_quietly(key)
            raise

    def _loader(self, key: str, prompt_len: int) -> Callable[[Any, int], Any]:
        def load_kv(cache: Any, slot: int) -> Any:
            t0 = time.monotonic()
            handle = self.receiver.receive_into(key, prompt_len, cache, slot,
                                                lambda: self.engine.is_cancelled(key))
            if self.on_kv is not None:
                self.on_kv(time.monotonic() - t0)
            self.transport.release(key)  # the bytes are ours now; blobs never outlive the request
            return handle.first_tokens or handle.first_token

        return load_kv

    def _local_loader(self, key: str, token_ids: list[int], params: SamplingParams
                      ) -> Callable[[Any, int], Any]:
        def load_kv(cache: Any, slot: int) -> Any:
            def into_slot(layer: int, k: Any, v: Any) -> None:
                cache.load(slot, layer, k, v)

            assert self.local is not None
            with self._local_lock:
                return self.local.prefill(key, token_ids, params, on_layer=into_slot).first

        return load_kv

    def _forward(self, key: str, n: int, emit: Emit, with_first: bool = False
                 ) -> Callable[[TokenEvent], None]:
        """Engine events -> emit; each choice's first token's event carries no id (pd has them from
        prefill) unless this instance prefilled the request (`with_first`). The request ends (final)
        when all n choices have, or at the first error or cancel."""
        seen_first: set[int] = set(range(n)) if with_first else set()
        running = [n]
        lock = threading.Lock()  # first events come from the submitting or a loader thread

        def on_event(ev: TokenEvent) -> None:
            with lock:
                first = ev.index not in seen_first
                seen_first.add(ev.index)
                running[0] -= ev.finished
                final = running[0] == 0
            ids = [] if ev.token_id is None or first else [ev.token_id]
            if ev.finished and ev.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR):
                self._release_quietly(key)  # a failed or cancelled request may have left blobs
            if ev.error is not None:
                emit(Out([], error=ev.error, final=True))
            elif ev.finished and ev.finish_reason == FinishReason.CANCELLED:
                emit(Out([], error=errors.RequestCancelled("cancelled", key=ev.key), final=True))
            elif ids or ev.finished:
                emit(Out(ids, ev.finish_reason or "", None, ev.index, [ev.logprobs] if ids else [], final))

        return on_event

    def cancel(self, key: str) -> bool:
        """Stop `key` wherever it is (queued, loading, decoding, not started yet); release its KV.
        Idempotent."""
        found = self.engine.cancel(key)
        self._release_quietly(key)
        return found

    def _release_quietly(self, key: str) -> None:
        try:
            self.transport.release(key)
        except errors.TransportError:
            pass  # the transport's TTL frees what a dead relay could not

    def install(self, loaded: Any) -> None:
        """Serve `loaded` (a committed weight generation): KV handles must carry its fingerprint
        from now on, so KV made with the old weights is refused."""
        self.loaded = self.engine.loaded = loaded
        self.receiver.spec = dataclasses.replace(self.receiver.spec, fingerprint=loaded.fingerprint)
        if self.local is not None:
            self.local.loaded = loaded

    def stats(self) -> dict:
        return self.engine.stats()

    def in_flight(self) -> int:
        """Requests holding anything here: queued, loading or decoding."""
        s = self.stats()
        return s["queued"] + s["loading"] + s["active"]

    def load(self) -> Any:
        """The endpoint picker's view: queued, holding a slot, slots in use over all slots."""
        s = self.stats()
        return Load(s["queued"], s["loading"] + s["active"], 1.0 - s["free_slots"] / s["num_slots"])

    def close(self) -> None:
        self.engine.stop()
        self.transport.close()
        self.loaded.close()  # lets go of the weight store


class DecodeModel:
    """Triton adapter: decoupled; `execute` only starts requests. Responses go out through the
    instance's one sender thread (`rngd_pd.stubs.sending`): the scheduler and loader threads only
    queue them."""

    def initialize(self, args: dict) -> None:
        p = transport_params(DecodeParams, args)
        name = args.get("model_name", "decode")
        self.metrics = triton_metrics(name)
        runtime = load_for(p, args, "decode")
        runtime.loaded.model.pack = p.pack_weights
        self.service = DecodeService(runtime, transport_for(p), p.kv_dtype,
                                     p.num_slots, p.max_len, p.max_queue, p.kv_timeout_s,
                                     on_kv=lambda s: self.metrics.record_kv_transfer(s, p.kv_transport),
                                     local_prefill_tokens=p.local_prefill_tokens,
                                     step_target_ms=p.step_target_ms, kv_cache_mb=p.kv_cache_mb)
        pbutils.log(f"{args.get('model_instance_name', name)}: {self.service.capacity.reason}")
        t = self.service.threshold
        pbutils.log(f"{args.get('model_instance_name', name)}: prompts up to {t.tokens} tokens are prefilled "
                    f"here when pd sends them ({t.reason})")
        self.responses = ResponseLoop(name)
        self.weights = WeightsControl(self.service.engine.runtime, self.service.install,
                                      args.get("model_instance_name", name), busy=self.service.in_flight)
        self.load_gauges = load_gauges("decode", self.service.load, self.metrics.sink)
        self._family = pbutils.metric_family(IN_FLIGHT, "decode requests waiting for KV, queued or decoding",
                                             "GAUGE")
        self._in_flight = self._family.Metric(labels={"model": name})

    def execute(self, requests: list) -> None:
        for request in requests:
            self._one(request)

    def _one(self, request: Any) -> None:
        stream = self.responses.open(request, T.DECODE)
        try:
            key = pbutils.input_scalar(request, T.REQUEST_KEY, "")
            if not key:
                raise errors.ConfigError(f"input {T.REQUEST_KEY!r} is required")
            if pbutils.input_scalar(request, T.CANCEL, False):
                self.service.cancel(key)
                stream.send({T.OUTPUT_IDS: [], T.FINISH_REASON: FinishReason.CANCELLED}, final=True)
                return
            op = pbutils.input_scalar(request, T.WEIGHTS_OP)
            if op:
                stream.send({T.OUTPUT_IDS: [], T.FINISH_REASON: "",
                             T.WEIGHTS_STATE: [json.dumps(self.weights.handle(op))]}, final=True)
                return
            if pbutils.input_scalar(request, T.DESCRIBE, False):
                stream.send({T.OUTPUT_IDS: [], T.FINISH_REASON: "",
                             T.LOCAL_PREFILL_TOKENS: [self.service.threshold.tokens]}, final=True)
                return
            get = getter(request)
            local = pbutils.input_array(request, T.INPUT_IDS) is not None
            token_ids = inputs.token_ids(get) if local else None
            prompt_len = pbutils.input_scalar(request, T.PROMPT_LEN)
            if prompt_len is None and token_ids is None:
                raise errors.ConfigError(f"input {T.PROMPT_LEN!r} (or {T.INPUT_IDS!r}) is required to start "
                                         "a request")
            params = inputs.sampling_params(get)
            prompt_ids = inputs.token_ids(get, T.PROMPT_IDS) if get(T.PROMPT_IDS) is not None else ()
            stream.on_cancel = lambda: self.service.cancel(key)  # a gRPC caller that cancelled
            self.service.start(key, int(prompt_len or 0), params, self._emitter(stream), token_ids,
                               prompt_ids)
        except Exception as exc:
            self._fail(stream, exc)
        self._in_flight.set(self.service.in_flight())

    @staticmethod
    def _fail(stream: Any, exc: BaseException) -> None:
        """End a request that failed. A cancelled one ends with a plain final response, finish_reason
        "cancelled", not an error: after a client cancelled pd's request, Triton 2.51 never delivered
        decode's final *error* response to pd's BLS stream (a plain one arrives), and pd's thread
        waiting on that stream stayed parked for good, one per cancelled request."""
        if isinstance(exc, errors.RequestCancelled):
            stream.send({T.OUTPUT_IDS: [], T.FINISH_REASON: FinishReason.CANCELLED}, final=True)
        else:
            stream.fail(exc)

    def _emitter(self, stream: Any) -> Emit:
        failed = [False]  # after an error or cancel, the other choices' events are dropped

        def emit(out: Out) -> None:
            if failed[0]:
                return
            if out.error is not None:
                failed[0] = True
                self._fail(stream, out.error)
            else:
                lp_ids, lp_values = logprobs.flatten(out.logprobs)
                stream.send({T.OUTPUT_IDS: out.ids, T.FINISH_REASON: out.reason, T.INDEX: [out.index],
                             T.TOKEN_LOGPROB_IDS: lp_ids, T.TOKEN_LOGPROBS: lp_values,
                             T.PROMPT_LOGPROB_IDS: [], T.PROMPT_LOGPROB_VALUES: []}, final=out.final)
            if out.error is not None or out.reason:
                self._in_flight.set(self.service.in_flight())

        return emit

    def finalize(self) -> None:
        self.weights.close()
        if self.load_gauges is not None:
            self.load_gauges.close()
        self.service.close()
        self.responses.close()
        self.metrics.close()
        self._in_flight = self._family = None
