"""The `prefill` model: token ids + request key -> first token; each layer's KV is pushed through the
transport as soon as it is computed (`KVSender` as the engine's on_layer hook), the handle last.
With `cache_only` it computes the prompt's KV into its prefix cache instead and answers how many
tokens that holds (pd's chunked prefill, rngd_pd.engine.prefill_queue).

`PrefillService` is the logic (a test drives it without Triton); `PrefillModel` adapts it for Triton.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from rngd_pd import errors
from rngd_pd.config import kv_events
from rngd_pd.config.params import instance_index
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.kv_events.publisher import EventSink, NullPublisher, ZmqPublisher, open_publisher
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.request import PrefillResult
from rngd_pd.kv.handle import KVHandle, KVSpec
from rngd_pd.kv.handoff import KVSender
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.stubs import pbutils
from rngd_pd.stubs.loading import load_for
from rngd_pd.stubs.metrics import Load, load_gauges, triton_metrics
from rngd_pd.stubs.serving import PrefillParams, getter, transport_for, transport_params
from rngd_pd.stubs.weights import WeightsControl
from rngd_pd.wire import inputs, logprobs
from rngd_pd.wire import tensors as T


class PrefillService:
    """One prefill engine + one transport; `prefill` is called by one thread at a time per instance."""

    def __init__(self, loaded: Any, transport: Any, kv_dtype: str = "bf16", chunk_size: int | None = 512,
                 max_len: int | None = None, prefix_cache_bytes: int = 0, prefix_block: int = 16,
                 events: EventSink | None = None) -> None:
        """loaded: a DeviceRuntime (loading.load_for), or a LoadedModel to run on the CPU; `events`
        publishes the prefix cache's changes (KV events)."""
        self.runtime = as_runtime(loaded)
        self.loaded, self.transport, self.kv_dtype = self.runtime.loaded, transport, kv_dtype
        self.engine = PrefillEngine(self.runtime, kv_dtype, chunk_size or None, max_context=max_len,
                                    prefix_cache_bytes=prefix_cache_bytes, prefix_block=prefix_block,
                                    events=events)
        loaded, c = self.loaded, self.loaded.config
        self.spec = KVSpec(loaded.fingerprint, c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)

    def prefill(self, key: str, token_ids: Sequence[int], params: SamplingParams
                ) -> tuple[KVHandle, float, PrefillResult]:
        """Prefill, push every blob and the handle; returns (handle, seconds spent pushing, the
        engine's result: each choice's first token and logprobs, prompt tokens reused from the
        prefix cache, the prompt's logprobs)."""
        self.engine.validate(key, token_ids, params)  # reject before anything is pushed
        sender = KVSender(self.transport, key, self.spec, self.runtime.to_host)
        result = self.engine.prefill(key, token_ids, params, on_layer=sender.on_layer)
        handle = sender.finish(result.first_token, result.num_tokens, [f.token for f in result.first])
        return handle, sender.push_s, result

    def install(self, loaded: Any) -> None:
        """Serve `loaded` (a committed weight generation): its fingerprint goes into every handle
        from now on, and prefixes cached with the old weights are dropped."""
        self.loaded = self.engine.loaded = loaded
        self.spec = dataclasses.replace(self.spec, fingerprint=loaded.fingerprint)
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.clear()

    def close(self) -> None:
        self.transport.close()
        self.loaded.close()  # lets go of the weight store


def kv_events_publisher(args: Mapping[str, Any]) -> ZmqPublisher | NullPublisher:
    """The KV event publisher $RNGD_PD_KV_EVENTS_CONFIG asks for (off: a NullPublisher); instance r of
    the model publishes on the configured port + r with data_parallel_rank r (vLLM's rule). A bad
    configuration or a port in use fails the model's load."""
    cfg = kv_events.from_env()
    rank = instance_index(args.get("model_instance_name", ""))
    publisher = open_publisher(cfg, rank)
    if isinstance(publisher, ZmqPublisher):
        pbutils.log(f"{args.get('model_instance_name', '?')}: KV events on {publisher.endpoint} "
                    f"(replay {publisher.replay_endpoint or 'off'}, topic {cfg.topic!r})")
    return publisher


class PrefillModel:
    """Triton adapter: one response per request (not decoupled)."""

    def initialize(self, args: dict) -> None:
        p = transport_params(PrefillParams, args)
        self.transport_name = p.kv_transport
        self.events = kv_events_publisher(args)
        try:
            self.service = PrefillService(load_for(p, args, "prefill"), transport_for(p), p.kv_dtype,
                                          p.chunk_size, p.max_len, **p.prefix_kwargs(), events=self.events)
        except BaseException:
            self.events.close()  # its sockets are bound: let go of the ports for the next load
            raise
        self.service.runtime.compute_thread()  # the stub runs a non-decoupled model's execute here
        self.weights = WeightsControl(self.service.runtime, self.service.install,
                                      args.get("model_instance_name", "prefill"))
        self.metrics = triton_metrics(args.get("model_name", "prefill"))
        self._waiting = self._running = 0
        self._events_seen = (0, 0)
        self.load_gauges = load_gauges("prefill", self.load, self.metrics.sink)

    def load(self) -> Any:
        """The endpoint picker's view: requests of this batch not started yet, the one running (a
        prefill holds no KV once it is handed over)."""
        return Load(self._waiting, self._running)

    def execute(self, requests: list) -> list:
        out = []
        self._waiting = len(requests)
        for request in requests:
            self._waiting -= 1
            self._running = 1
            try:
                out.append(self._one(request))
            finally:
                self._running = 0
        return out

    def _one(self, request: Any) -> Any:
        try:
            op = pbutils.input_scalar(request, T.WEIGHTS_OP)
            if op:
                state = json.dumps(self.weights.handle(op))
                return pbutils.make_response(T.PREFILL, {T.WEIGHTS_STATE: [state]},
                                             pbutils.requested_outputs(request))
            get = getter(request)
            key = pbutils.input_scalar(request, T.REQUEST_KEY, "")
            if not key:
                raise errors.ConfigError(f"input {T.REQUEST_KEY!r} is required")
            ids = inputs.token_ids(get)
            if pbutils.input_scalar(request, T.CACHE_ONLY, False):
                cached, reused = self.service.engine.cache_prefix(key, ids)
                if reused:  # its tokens count as queried with the last chunk
                    self.metrics.record_prefix(0, reused)
                self._count_events()
                return pbutils.make_response(T.PREFILL, {T.CACHED_TOKENS: [cached]},
                                             pbutils.requested_outputs(request))
            # prefill samples one token; decode checks the real max_tokens against the context
            params = inputs.sampling_params(get, max_tokens=1)
            handle, push_s, result = self.service.prefill(key, ids, params)
        except Exception as exc:
            return pbutils.error_response(exc)
        self.metrics.record_kv_transfer(push_s, self.transport_name)
        if self.service.engine.prefix_cache is not None:
            self.metrics.record_prefix(len(ids), result.cached_tokens)
        self._count_events()
        first_ids, first_values = logprobs.flatten([f.logprobs for f in result.first])
        prompt_ids, prompt_values = logprobs.flatten(result.prompt_logprobs or [])
        outputs = {T.FIRST_TOKEN: [handle.first_token], T.KV_HANDLE: handle.to_json,
                   T.FIRST_TOKENS: [f.token for f in result.first],
                   T.TOKEN_LOGPROB_IDS: first_ids, T.TOKEN_LOGPROBS: first_values,
                   T.PROMPT_LOGPROB_IDS: prompt_ids, T.PROMPT_LOGPROB_VALUES: prompt_values,
                   T.CACHED_TOKENS: [result.cached_tokens]}
        return pbutils.make_response(T.PREFILL, outputs, pbutils.requested_outputs(request))

    def _count_events(self) -> None:
        """The publisher's batches queued and dropped since the last request, as counters."""
        now = (self.events.published, self.events.dropped)
        if now != self._events_seen:
            self.metrics.record_kv_events(now[0] - self._events_seen[0], now[1] - self._events_seen[1])
            self._events_seen = now

    def finalize(self) -> None:
        self.weights.close()
        if self.load_gauges is not None:
            self.load_gauges.close()
        self.service.close()
        self.events.close()
        self.metrics.close()
