"""The `decode` model (decoupled): request key + prompt length + sampling -> a stream of tokens.

It is started together with prefill: a loader thread pulls each layer's KV as prefill pushes it (the
transfer overlaps prefill), then the handle with the first token, validates all of it, releases the
key on the transport and submits the request to the continuous-batching `DecodeEngine`, which copies
the KV into its slot. The stream carries the tokens after the first one (pd already has the first from
prefill) and ends with the finish reason. It never recomputes the prompt.

A request with `cancel=true` stops the key instead: the engine frees the slot, a KV wait is abandoned,
the KV is released; keys cancelled before their start request arrives are remembered for a while.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rngd_pd import errors
from rngd_pd.engine.request import DecodeRequest, TokenEvent
from rngd_pd.kv.handle import KVSpec
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.triton.kv_io import KVReceiver
from rngd_pd.triton.params import kv_torch_dtype

Emit = Callable[[list[int], str, "BaseException | None"], None]  # (new ids, finish reason, error)
CANCEL_MEMORY_S = 120.0
IN_FLIGHT = "airm_decode_requests_in_flight"


class DecodeService:
    """DecodeEngine + transport + KV loaders; thread-safe. `emit` gets (ids, finish_reason, error)."""

    def __init__(self, loaded: Any, transport: Any, kv_dtype: str = "bf16", num_slots: int = 8,
                 max_len: int = 4096, max_queue: int = 64, kv_timeout_s: float = 60.0,
                 on_kv: Callable[[float], None] | None = None) -> None:
        from rngd_pd.engine.decode import DecodeEngine

        c = loaded.config
        self.loaded, self.transport = loaded, transport
        spec = KVSpec(loaded.fingerprint, c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
        self.receiver = KVReceiver(transport, spec, timeout_s=kv_timeout_s)
        self.engine = DecodeEngine(loaded, num_slots, max_len, kv_torch_dtype(kv_dtype), max_queue)
        self.engine.start()
        self._loaders = ThreadPoolExecutor(num_slots + max_queue, thread_name_prefix="decode-kv-pull")
        self._lock = threading.Lock()
        self._cancelled: dict[str, float] = {}  # key -> when
        self._pulling: set[str] = set()
        self.on_kv = on_kv  # gets each request's KV wait + transfer seconds (metrics)

    def start(self, key: str, prompt_len: int, params: SamplingParams, emit: Emit) -> None:
        """Begin one request; raises ConfigError/ContextLengthError/CapacityError before anything runs."""
        from rngd_pd.engine.request import check_request

        check_request(prompt_len, params, self.engine.buckets[-1].max_len, key=key)
        with self._lock:
            if self._cancelled.pop(key, None) is not None:
                raise errors.RequestCancelled("cancelled before decode started", key=key)
            if key in self._pulling:
                raise errors.ConfigError("a request with this key is already in flight", key=key)
            self._pulling.add(key)
        self._loaders.submit(self._load_and_submit, key, prompt_len, params, emit)

    def _load_and_submit(self, key: str, prompt_len: int, params: SamplingParams, emit: Emit) -> None:
        t0 = time.monotonic()
        try:
            handle, kv = self.receiver.receive(key, prompt_len, lambda: self._is_cancelled(key))
            if self.on_kv is not None:
                self.on_kv(time.monotonic() - t0)
            self.transport.release(key)  # the bytes are ours now; blobs never outlive the request
            with self._lock:
                self._pulling.discard(key)
            self.engine.submit(DecodeRequest(key, prompt_len, handle.first_token, params,
                                             lambda cache, slot: cache.load_all(slot, kv),
                                             self._forward(handle.first_token, emit)))
            if self._is_cancelled(key):  # a cancel that raced the hand-over to the engine
                self.engine.cancel(key)
        except BaseException as exc:
            with self._lock:
                self._pulling.discard(key)
            self._release_quietly(key)
            emit([], "", exc)

    @staticmethod
    def _forward(first_token: int, emit: Emit) -> Callable[[TokenEvent], None]:
        """Engine events -> emit; the first token's event carries no id (pd has it from prefill)."""
        seen_first = [False]

        def on_event(ev: TokenEvent) -> None:
            ids = [] if ev.token_id is None or not seen_first[0] else [ev.token_id]
            seen_first[0] = True
            if ev.error is not None:
                emit([], "", ev.error)
            elif ev.finished and ev.finish_reason == "cancelled":
                emit([], "", errors.RequestCancelled("cancelled", key=ev.key))
            elif ids or ev.finished:
                emit(ids, ev.finish_reason or "", None)

        return on_event

    def cancel(self, key: str) -> bool:
        """Stop `key` wherever it is (waiting for KV, queued, decoding); release its KV. Idempotent."""
        now = time.monotonic()
        with self._lock:
            self._cancelled = {k: t for k, t in self._cancelled.items() if now - t < CANCEL_MEMORY_S}
            self._cancelled[key] = now
            pulling = key in self._pulling
        found = self.engine.cancel(key)
        if found:
            with self._lock:
                self._cancelled.pop(key, None)
        self._release_quietly(key)
        return found or pulling

    def _is_cancelled(self, key: str) -> bool:
        with self._lock:
            return key in self._cancelled

    def _release_quietly(self, key: str) -> None:
        try:
            self.transport.release(key)
        except errors.TransportError:
            pass  # the transport's TTL frees what a dead relay could not

    def stats(self) -> dict:
        with self._lock:
            pulling = len(self._pulling)
        return {**self.engine.stats(), "pulling_kv": pulling}

    def in_flight(self) -> int:
        """Requests holding anything here: waiting for KV, queued, loading or decoding."""
        s = self.stats()
        return s["pulling_kv"] + s["queued"] + s["loading"] + s["active"]

    def close(self) -> None:
        self.engine.stop()
        self._loaders.shutdown(wait=False, cancel_futures=True)
        self.transport.close()


class DecodeModel:
    """Triton adapter: decoupled; `execute` only starts requests, responses come from engine threads."""

    def initialize(self, args: dict) -> None:
        from rngd_pd.kv import load_transport
        from rngd_pd.triton.metrics import triton_metrics
        from rngd_pd.triton.serving import DecodeParams, load_for, model_params

        p = model_params(DecodeParams, args)
        self.metrics = triton_metrics(args.get("model_name", "decode"))
        self.service = DecodeService(load_for(p, args), load_transport(p.kv_transport), p.kv_dtype,
                                     p.num_slots, p.max_len, p.max_queue, p.kv_timeout_s,
                                     on_kv=lambda s: self.metrics.record_kv_transfer(s, p.kv_transport))
        from rngd_pd.triton import pbutils

        self._family = pbutils.metric_family(IN_FLIGHT, "decode requests waiting for KV, queued or decoding",
                                             "GAUGE")
        self._in_flight = self._family.Metric(labels={"model": args.get("model_name", "decode")})

    def execute(self, requests: list) -> None:
        for request in requests:
            self._one(request)

    def _one(self, request: Any) -> None:
        from rngd_pd.triton import inputs, pbutils
        from rngd_pd.triton import tensors as T
        from rngd_pd.triton.serving import getter

        sender = request.get_response_sender()
        try:
            key = pbutils.input_scalar(request, T.REQUEST_KEY, "")
            if not key:
                raise errors.ConfigError(f"input {T.REQUEST_KEY!r} is required")
            if pbutils.input_scalar(request, T.CANCEL, False):
                self.service.cancel(key)
                pbutils.send(sender, pbutils.make_response(T.DECODE, {T.FINISH_REASON: "cancelled"}),
                             final=True)
                return
            prompt_len = pbutils.input_scalar(request, T.PROMPT_LEN)
            if prompt_len is None:
                raise errors.ConfigError(f"input {T.PROMPT_LEN!r} is required to start a request")
            params = inputs.sampling_params(getter(request))
            self.service.start(key, int(prompt_len), params, self._emitter(sender))
        except Exception as exc:
            self._fail(sender, exc)
        self._in_flight.set(self.service.in_flight())

    @staticmethod
    def _fail(sender: Any, exc: BaseException) -> None:
        """End a request that failed. A cancelled one ends with a plain final response, finish_reason
        "cancelled", not an error: after a client cancelled pd's request, Triton 2.51 never delivered
        decode's final *error* response to pd's BLS stream (a plain one arrives), and pd's thread
        waiting on that stream stayed parked for good, one per cancelled request."""
        from rngd_pd.triton import pbutils
        from rngd_pd.triton import tensors as T

        if isinstance(exc, errors.RequestCancelled):
            response = pbutils.make_response(T.DECODE, {T.OUTPUT_IDS: [], T.FINISH_REASON: "cancelled"})
            pbutils.send(sender, response, final=True)
        else:
            pbutils.send_error(sender, exc)

    def _emitter(self, sender: Any) -> Emit:
        from rngd_pd.triton import pbutils
        from rngd_pd.triton import tensors as T

        def emit(ids: list[int], reason: str, error: BaseException | None) -> None:
            if error is not None:
                self._fail(sender, error)
            else:
                response = pbutils.make_response(T.DECODE, {T.OUTPUT_IDS: ids, T.FINISH_REASON: reason})
                pbutils.send(sender, response, final=bool(reason))
            if error is not None or reason:
                self._in_flight.set(self.service.in_flight())

        return emit

    def finalize(self) -> None:
        self.service.close()
        self.metrics.close()
        self._in_flight = self._family = None

