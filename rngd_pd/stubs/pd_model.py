"""The `pd` model (BLS orchestrator, decoupled) and the `colocated` model (same interface, no transfer).

Both run each request on a fixed pool of workers (`execute` only admits it) and send `Chunk`s as
responses through the instance's one sender thread (`rngd_pd.stubs.sending`):
`output_ids`, `finish_reason` (empty until the last) and `context_ids` for the stateless postprocess.
`pd` reaches prefill by BLS and decode through this tritonserver's own gRPC endpoint (`decode_via`),
or either by gRPC to another server when `prefill_url` / `decode_url` are set; `colocated` runs
prefill and decode in one instance (ColocatedEngine), the baseline the benches compare pd with.

Decode is not reached by decoupled BLS because Triton 2.51's stub deadlocks under concurrent decoupled
BLS streams (the lock cycle and its reproduction, `bench/bls_deadlock.py`: docs/serving.md, "What
Triton 2.51's Python backend really does"). Prefill's BLS call returns one response and makes no
iterator, so it stays BLS.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from rngd_pd import errors
from rngd_pd.engine.capacity import decode_slots
from rngd_pd.engine.chunks import Chunk, ChunkEmitter, context_len
from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.engine.orchestrator import Orchestrator, RunStats
from rngd_pd.engine.request import PrefillResult
from rngd_pd.engine.switch import Gate, WeightSwitch
from rngd_pd.engine.workers import RequestPool
from rngd_pd.host.stubs import UNLOADING_LINE, SiblingWatch
from rngd_pd.model.params import PREFILLER_HEADER, prefiller_address
from rngd_pd.model.sampling import FinishReason, SamplingParams
from rngd_pd.stubs import pbutils
from rngd_pd.stubs.clients import RETIRED, BlsClient, GrpcClient, local_grpc_url
from rngd_pd.stubs.loading import load_for
from rngd_pd.stubs.metrics import Load, load_gauges, triton_metrics
from rngd_pd.stubs.sending import ResponseLoop, Stream
from rngd_pd.stubs.serving import ColocatedParams, PdParams, getter, model_params
from rngd_pd.stubs.text_models import CONTEXT_IDS, spec_for
from rngd_pd.stubs.weights import parse_op
from rngd_pd.wire import inputs, logprobs
from rngd_pd.wire import tensors as T
from rngd_pd.wire.weights import DRAIN_S

PD_OPS = ("apply_delta", "hold", "release", "state")  # the weight operations pd takes (_weights)


class _GenerationModel:
    """The shared decoupled skeleton: `execute` only admits requests; a fixed pool of workers runs
    them, and one sender thread per instance sends every response and reads the cancel flags."""

    name = "generation"

    def _init_serving(self, args: dict, max_inflight: int, max_queue: int,
                      fence: Callable[[Callable[[], None]], Any] | None = None,
                      idle: Callable[[], Any] | None = None,
                      health: Callable[[], BaseException | None] | None = None) -> None:
        self.name = args.get("model_name", self.name)
        self.spec = spec_for(self.name if self.name in ("pd", "colocated") else "pd")
        self.metrics = triton_metrics(self.name)
        self.responses = ResponseLoop(self.name, fence=fence, idle=idle, health=health)
        self.pool = RequestPool(f"{self.name}-request", max_inflight, max_queue)
        self.control = RequestPool(f"{self.name}-weights", 1, 4)  # weight operations, one at a time
        self.load_gauges: Any = None  # pd's, on a gateway (metrics.load_gauges)

    def execute(self, requests: list) -> None:
        for request in requests:
            stream = self.responses.open(request, self.spec)
            if pbutils.input_scalar(request, T.ERRORS_IN_BAND, False):  # inside llm (tensors.ERROR)
                stream.in_band = _in_band_error
            op = pbutils.input_scalar(request, T.WEIGHTS_OP)
            try:
                if op:
                    self.control.submit(self._control, op, stream)
                else:
                    self.pool.submit(self._work, request, stream)
            except Exception as exc:
                stream.fail(exc)

    def _control(self, text: str, stream: Stream) -> None:
        try:
            state = self._weights(text)
        except BaseException as exc:
            stream.fail(exc)
            return
        stream.send({T.OUTPUT_IDS: [], T.FINISH_REASON: "", T.WEIGHTS_STATE: [json.dumps(state)]}, final=True)

    def _weights(self, text: str) -> dict[str, Any]:
        """A weight operation (pd: rngd_pd.engine.switch)."""
        raise errors.ConfigError(f"{self.name} takes no weight operations; send them to pd")

    def _work(self, request: Any, stream: Stream) -> None:
        try:
            get = getter(request)
            ids = inputs.token_ids(get)
            params = inputs.sampling_params(get)
            want_stream = bool(pbutils.input_scalar(request, T.STREAM, False))
            prefill_at = pbutils.request_parameter(request, PREFILLER_HEADER)
            prefill_at = prefiller_address(prefill_at) if prefill_at else None
            stop = list(params.stop)

            def emit(chunk: Chunk) -> None:
                stream.send({T.OUTPUT_IDS: chunk.token_ids, T.FINISH_REASON: chunk.finish_reason,
                             CONTEXT_IDS: chunk.context_ids, T.STOP: stop, T.ERROR: "",
                             **logprob_outputs(chunk)}, final=chunk.final)

            stats = self._run(ids, params, want_stream, emit, stream.cancelled.is_set, prefill_at)
        except BaseException as exc:  # every request ends with exactly one final response
            if not isinstance(exc, errors.RngdPdError | ValueError):
                pbutils.log(f"{self.name}: unexpected {exc!r}", "error")
            stream.fail(exc)
            return
        self.metrics.record_request(stats.first_token_at - stats.start, stats.tokens, stats.end - stats.start)
        if self.name == "pd":
            self.metrics.record_prefill_path(stats.local_prefill)

    def _run(self, ids: list[int], params: SamplingParams, stream: bool, emit: Callable[[Chunk], None],
             cancelled: Callable[[], bool], prefill_at: str | None = None) -> RunStats:
        """One request; `prefill_at` is the prefill server llm-d's endpoint picker chose (pd only)."""
        raise NotImplementedError

    def load(self) -> Any:
        """The endpoint picker's view of this model: queued and running requests (the KV is on
        the decode servers)."""
        n = self.pool.in_flight()
        return Load(max(0, n - self.pool.workers), min(n, self.pool.workers))

    def finalize(self) -> None:
        pbutils.log(f"{self.name}: {UNLOADING_LINE}")  # serve's stub watch: not a crash
        if self.load_gauges is not None:
            self.load_gauges.close()
        self.responses.close()
        self.pool.close()
        self.control.close()
        self.metrics.close()


def _in_band_error(exc: BaseException) -> dict[str, Any]:
    """A failed request's final outputs for postprocess, which answers the error (tensors.ERROR)."""
    return {T.OUTPUT_IDS: [], T.FINISH_REASON: FinishReason.ERROR, CONTEXT_IDS: [], T.STOP: [],
            T.ERROR: errors.to_wire(exc), **logprob_outputs(Chunk([], []))}


def logprob_outputs(chunk: Chunk) -> dict[str, list]:
    """A chunk's choice index and logprob tensors (rngd_pd.wire.logprobs), always all of them: the
    llm ensemble maps each to postprocess."""
    ids, values = logprobs.flatten(chunk.logprobs or [])
    prompt_ids, prompt_values = logprobs.flatten(chunk.prompt_logprobs or [])
    return {T.INDEX: [chunk.index], T.TOKEN_LOGPROB_IDS: ids, T.TOKEN_LOGPROBS: values,
            T.PROMPT_LOGPROB_IDS: prompt_ids, T.PROMPT_LOGPROB_VALUES: prompt_values}


class PdModel(_GenerationModel):
    """`pd`: one request = prefill + decode, by BLS here or gRPC to other servers."""

    name = "pd"

    def initialize(self, args: dict) -> None:
        p = model_params(PdParams, args)
        prefill = GrpcClient(p.prefill_url) if p.prefill_url else BlsClient()
        decode = GrpcClient(p.decode_url) if p.decode_url else _local_decode_client(p.decode_via)
        # every cancel pass of the sender doubles as the fence that lets finished BLS streams go; the
        # stubs of the models reached by BLS are watched, so a dead one fails its waiting requests
        reached = ((p.prefill_model, p.prefill_url), (p.decode_model, p.decode_url))
        local = tuple(model for model, url in reached if not url)
        self.siblings = SiblingWatch(local) if local else None
        self._init_serving(args, p.max_inflight, p.max_queue, fence=RETIRED.fenced, idle=RETIRED.drop_settled,
                           health=self.siblings.check if self.siblings else None)
        self.orchestrator = Orchestrator(prefill, decode, prefill_model=p.prefill_model,
                                         decode_model=p.decode_model, max_streams=p.max_inflight,
                                         local_prefill_tokens=p.local_prefill_tokens,
                                         local_prefill_when=p.local_prefill_when, connect=GrpcClient,
                                         prefill_slots=p.prefill_slots, prefill_chunk=p.prefill_chunk,
                                         prefill_aging=p.prefill_aging)
        self.gate = Gate()  # closed while the weights switch (rngd_pd.engine.switch)
        self.switch = WeightSwitch(prefill, decode, self.gate, prefill_model=p.prefill_model,
                                   decode_model=p.decode_model)

        self.load_gauges = load_gauges("pd", self.load, self.metrics.sink)

    def _run(self, ids: list[int], params: SamplingParams, stream: bool, emit: Callable[[Chunk], None],
             cancelled: Callable[[], bool], prefill_at: str | None = None) -> RunStats:
        with self.gate.passage(cancelled):
            return self.orchestrator.run(ids, params, stream, emit, cancelled, prefill_at=prefill_at)

    def _weights(self, text: str) -> dict[str, Any]:
        """`{"op": "apply_delta", "checkpoint": DIR, "drain_s": S}`, `{"op": "hold", "drain_s": S,
        "max_hold_s": S}` / `{"op": "release"}` (around a variant swap), or `{"op": "state"}`."""
        kind, op = parse_op(text, PD_OPS)
        if kind == "apply_delta" and op.get("checkpoint"):
            result = self.switch.apply_delta(str(op["checkpoint"]), float(op.get("drain_s", DRAIN_S)))
            pbutils.log(f"pd: weight update {json.dumps(result)}")
            return result
        if kind == "state":
            return self.switch.state()
        if kind == "hold":  # a swap unloads a model pd watches: not a death (host.stubs.SiblingWatch)
            state = self.switch.hold(float(op.get("drain_s", DRAIN_S)), float(op.get("max_hold_s", 600.0)))
            if self.siblings is not None:
                self.siblings.pause()
            return state
        if kind == "release":
            if self.siblings is not None:
                self.siblings.resume()
            return self.switch.release()
        raise errors.ConfigError("pd's weight operations are apply_delta (with checkpoint), hold, release "
                                 f"and state, got {kind!r}")

    def finalize(self) -> None:
        super().finalize()
        self.orchestrator.close()
        RETIRED.drain()


def _local_decode_client(via: str) -> Any:
    """The client for a decode in this server: its own gRPC endpoint (module docstring), or BLS when
    asked for or when this server serves no plain gRPC (said in the log, with the fix)."""
    if via == "bls":
        pbutils.log("pd reaches decode by BLS (decode_via=bls), which can deadlock under concurrent "
                    "load in Triton 2.51 (docs/serving.md)", "warn")
        return BlsClient()
    url, why = local_grpc_url()
    if url is None:
        pbutils.log(f"pd reaches decode by BLS: {why}, so its own gRPC endpoint cannot be used; BLS can "
                    "deadlock under concurrent load in Triton 2.51: serve with plain gRPC enabled, or "
                    "set decode_url (docs/serving.md)", "warn")
        return BlsClient()
    pbutils.log(f"pd reaches decode through this server's gRPC endpoint {url} ({why})")
    return GrpcClient(url)


class ColocatedModel(_GenerationModel):
    """`colocated`: prefill and decode in this instance; the KV never leaves the process."""

    name = "colocated"

    def initialize(self, args: dict) -> None:
        p = model_params(ColocatedParams, args)
        runtime = load_for(p, args)
        slots = decode_slots(runtime, p.num_slots, p.max_len, p.kv_dtype, p.step_target_ms, p.kv_cache_mb)
        pbutils.log(f"{args.get('model_instance_name', self.name)}: {slots.reason}")
        self.engine = ColocatedEngine(runtime, slots.slots, p.max_len, p.kv_dtype,
                                      p.chunk_size or None, **p.prefix_kwargs())
        self._init_serving(args, p.max_inflight, p.max_queue)

    def _run(self, ids: list[int], params: SamplingParams, stream: bool, emit: Callable[[Chunk], None],
             cancelled: Callable[[], bool], prefill_at: str | None = None) -> RunStats:
        stats = RunStats(inputs.new_key(), time.monotonic())
        out = ChunkEmitter(stream, emit, context_len(params.stop), params.n)
        prompt: list = []  # the prefill's prompt logprobs, sent with the first chunk of choice 0

        def on_prefill(result: PrefillResult) -> None:
            prompt.append(result.prompt_logprobs)

        events = self.engine.stream(ids, params, key=stats.key, on_prefill=on_prefill)
        try:
            for ev in events:
                if cancelled():
                    raise errors.RequestCancelled("the client cancelled the request", key=stats.key)
                if not stats.first_token_at:
                    stats.first_token_at = time.monotonic()
                has_token = ev.token_id is not None
                out.add([ev.token_id] if has_token else [], ev.finish_reason or "", ev.index,
                        [ev.logprobs] if has_token and ev.logprobs is not None else None,
                        prompt.pop() if prompt and ev.index == 0 else None)
                stats.finish_reason = ev.finish_reason or stats.finish_reason
        finally:
            events.close()  # cancels the engine request when we stop early
        stats.end, stats.tokens = time.monotonic(), len(out.ids)
        return stats

    def finalize(self) -> None:
        super().finalize()
        self.engine.close()
