"""The `pd` model (BLS orchestrator, decoupled) and the `colocated` model (same interface, no transfer).

Both run each request on its own thread (`execute` only starts them) and send `Chunk`s as responses:
`output_ids`, `finish_reason` (empty until the last) and `context_ids` for the stateless postprocess.
`pd` reaches prefill/decode by BLS, or by gRPC when `prefill_url` / `decode_url` are set; `colocated`
runs prefill and decode in one instance (ColocatedEngine), the baseline the benches compare pd with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rngd_pd.model.sampling import SamplingParams
from rngd_pd.triton import inputs, pbutils
from rngd_pd.triton import tensors as T
from rngd_pd.triton.orchestrator import Chunk, ChunkEmitter, RunStats, context_len
from rngd_pd.triton.serving import getter, run_decoupled
from rngd_pd.triton.text_models import CONTEXT_IDS, spec_for


class _GenerationModel:
    """The shared decoupled skeleton: parse the request, run it on a thread, send chunks, metrics."""

    name = "generation"

    def _init_metrics(self, args: dict) -> None:
        from rngd_pd.triton.metrics import triton_metrics

        self.name = args.get("model_name", self.name)
        self.spec = spec_for(self.name if self.name in ("pd", "colocated") else "pd")
        self.metrics = triton_metrics(self.name)

    def execute(self, requests: list) -> None:
        for request in requests:
            run_decoupled(request, self._work, f"{self.name}-request")

    def _work(self, request: Any, sender: Any) -> None:
        get = getter(request)
        ids = inputs.token_ids(get)
        params = inputs.sampling_params(get)
        stream = bool(pbutils.input_scalar(request, T.STREAM, False))

        def emit(chunk: Chunk) -> None:
            response = pbutils.make_response(self.spec, {T.OUTPUT_IDS: chunk.token_ids,
                                                         T.FINISH_REASON: chunk.finish_reason,
                                                         CONTEXT_IDS: chunk.context_ids,
                                                         T.STOP: list(params.stop)})
            pbutils.send(sender, response, final=chunk.final)

        stats = self._run(ids, params, stream, emit, request.is_cancelled)
        self.metrics.record_request(stats.first_token_at - stats.start, stats.tokens, stats.end - stats.start)

    def _run(self, ids: list[int], params: SamplingParams, stream: bool, emit: Callable[[Chunk], None],
             cancelled: Callable[[], bool]) -> RunStats:
        raise NotImplementedError

    def finalize(self) -> None:
        self.metrics.close()


class PdModel(_GenerationModel):
    """`pd`: one request = prefill + decode, by BLS here or gRPC to other servers."""

    name = "pd"

    def initialize(self, args: dict) -> None:
        from rngd_pd.triton.clients import BlsClient, GrpcClient
        from rngd_pd.triton.orchestrator import Orchestrator
        from rngd_pd.triton.serving import PdParams, model_params

        p = model_params(PdParams, args)
        prefill = GrpcClient(p.prefill_url) if p.prefill_url else BlsClient()
        decode = GrpcClient(p.decode_url) if p.decode_url else BlsClient()
        self.orchestrator = Orchestrator(prefill, decode, prefill_model=p.prefill_model,
                                         decode_model=p.decode_model)
        self._init_metrics(args)

    def _run(self, ids: list[int], params: SamplingParams, stream: bool, emit: Callable[[Chunk], None],
             cancelled: Callable[[], bool]) -> RunStats:
        from rngd_pd.triton.clients import RETIRED

        # every cancel check doubles as the fence that lets finished BLS streams go (clients.py)
        return self.orchestrator.run(ids, params, stream, emit, lambda: RETIRED.fenced(cancelled))

    def finalize(self) -> None:
        from rngd_pd.triton.clients import RETIRED

        RETIRED.drain()
        super().finalize()


class ColocatedModel(_GenerationModel):
    """`colocated`: prefill and decode in this instance; the KV never leaves the process."""

    name = "colocated"

    def initialize(self, args: dict) -> None:
        from rngd_pd.engine.colocated import ColocatedEngine
        from rngd_pd.triton.params import kv_torch_dtype
        from rngd_pd.triton.serving import ColocatedParams, load_for, model_params

        p = model_params(ColocatedParams, args)
        self.engine = ColocatedEngine(load_for(p, args), p.num_slots, p.max_len, kv_torch_dtype(p.kv_dtype),
                                      p.chunk_size or None)
        self._init_metrics(args)

    def _run(self, ids: list[int], params: SamplingParams, stream: bool, emit: Callable[[Chunk], None],
             cancelled: Callable[[], bool]) -> RunStats:
        import time

        from rngd_pd import errors
        from rngd_pd.triton.inputs import new_key

        stats = RunStats(new_key(), time.monotonic())
        out = ChunkEmitter(stream, emit, context_len(params.stop))
        events = self.engine.stream(ids, params, key=stats.key)
        try:
            for ev in events:
                if cancelled():
                    raise errors.RequestCancelled("the client cancelled the request", key=stats.key)
                if not stats.first_token_at:
                    stats.first_token_at = time.monotonic()
                out.add([] if ev.token_id is None else [ev.token_id], ev.finish_reason or "")
                stats.finish_reason = ev.finish_reason or stats.finish_reason
        finally:
            events.close()  # cancels the engine request when we stop early
        stats.end, stats.tokens = time.monotonic(), len(out.ids)
        return stats

    def finalize(self) -> None:
        self.engine.close()
        super().finalize()
