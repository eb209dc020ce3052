"""The layer below the HTTP app: token ids in, streamed token ids out, over Triton's gRPC stream.

`Backend` is what the app needs; `TritonBackend` implements it with one grpc.aio channel and one
bidirectional `ModelStreamInfer` call per request. The request carries the tensor names of
`rngd_pd.wire.tensors` and the values of `rngd_pd.wire.inputs.sampling_values`, each in the datatype
the served model declares (`rngd_pd.wire.grpc_codec` builds the protobuf). Closing the generator
before the final response (client gone, stop string matched) cancels the gRPC call, which Triton
turns into a cancelled request that the decode engine drops from its slot.

After the final response the call is never cancelled nor dropped (`rngd_pd.wire.grpc_codec.finish`:
Triton 2.51 would otherwise keep the request's state and the model for good).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from rngd_pd import errors
from rngd_pd.frontend.api_errors import APIError, answer, bad_request
from rngd_pd.model.params import PREFILLER_HEADER, FinishReason, SamplingParams, TokenLogprobs
from rngd_pd.wire import grpc_codec, logprobs
from rngd_pd.wire import tensors as T
from rngd_pd.wire.grpc_codec import NP_DTYPES as _NP
from rngd_pd.wire.inputs import sampling_values
from rngd_pd.wire.weights import op_inputs, state_of

_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
META_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TokenChunk:
    """One streamed response: its new tokens, and the finish reason on the last one of its choice
    (`index`, of the request's n); their logprobs (one row per token) and, on the first chunk, the
    prompt's, when the request asked for them."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None  # set on the choice's final chunk only
    received_at: float = 0.0  # time.perf_counter() when it arrived (0 = unknown)
    index: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    input_ids: list[int]
    params: SamplingParams
    prefill_at: str | None = None  # host:port (gRPC) of the prefill server llm-d chose, if any


class Backend(Protocol):
    """What the HTTP app calls. Implementations are used from one event loop."""

    async def ready(self) -> str | None:
        """None when requests can be served, else why not (for /health's 503)."""

    async def max_len(self) -> int | None:
        """The longest prompt + max_tokens the server's model accepts; None when it does not say or
        cannot be asked now (the app then keeps the limit it had)."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Stream the request's tokens; the last chunk has finish_reason set.

        Raises APIError (503 `backend_unavailable` when Triton cannot be reached). Closing the iterator
        early (aclose, or cancelling the task awaiting it) cancels the request on the server.
        """

    async def weights(self, op: dict[str, Any]) -> dict[str, Any]:
        """Run a weight operation (rngd_pd.wire.weights) on the served model; its JSON answer.
        Blocks (asynchronously) for as long as the operation runs; raises APIError."""

    async def close(self) -> None:
        """Release connections; idempotent."""


@dataclass(frozen=True)
class _ModelInfo:
    inputs: dict[str, str]  # name -> Triton datatype
    batched: bool  # max_batch_size > 0: every tensor gets a leading batch dimension of 1
    max_len: int | None = None  # the served context limit (`max_len` parameters), None if unknown


class TritonBackend:
    """Backend over Triton's gRPC endpoint (`url` is HOST:PORT) for a decoupled `pd`-style model."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        self._info: _ModelInfo | None = None

    def _get_stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if self._stub is None:  # created lazily: a grpc.aio channel belongs to the running loop
            self._channel = grpc.aio.insecure_channel(self.url, options=grpc_codec.CHANNEL_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    async def ready(self) -> str | None:
        stub = self._get_stub()
        try:
            if not (await stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=2)).ready:
                return f"Triton at {self.url} is not ready"
            req = service_pb2.ModelReadyRequest(name=self.model)
            if not (await stub.ModelReady(req, timeout=2)).ready:
                return f"Triton model '{self.model}' is not ready"
            await self._model_info()
        except grpc.aio.AioRpcError as exc:
            return f"Triton at {self.url} is not reachable ({exc.code().name}: {exc.details()})"
        except APIError as exc:
            return exc.message
        return None

    async def _model_info(self) -> _ModelInfo:
        if self._info is None:
            stub = self._get_stub()
            meta = await stub.ModelMetadata(
                service_pb2.ModelMetadataRequest(name=self.model), timeout=META_TIMEOUT_S
            )
            cfg = await stub.ModelConfig(
                service_pb2.ModelConfigRequest(name=self.model), timeout=META_TIMEOUT_S
            )
            inputs = {t.name: t.datatype for t in meta.inputs}
            for name in (T.INPUT_IDS, T.MAX_TOKENS):
                if name not in inputs:
                    raise APIError(
                        502,
                        f"Triton model '{self.model}' has no input '{name}': is it a pd-style "
                        "model? (use --triton-model pd or colocated)",
                        type="server_error",
                    )
            max_len = await self._served_max_len(cfg.config)
            self._info = _ModelInfo(inputs, cfg.config.max_batch_size > 0, max_len)
        return self._info

    async def max_len(self) -> int | None:
        try:
            return (await self._model_info()).max_len
        except grpc.aio.AioRpcError as exc:
            _rpc_error(exc, self)  # forgets the model info, so it is read again once Triton is back
            return None
        except APIError:
            return None

    async def _served_max_len(self, config: model_config_pb2.ModelConfig) -> int | None:
        """The smallest `max_len` parameter of the model and, for the `pd` orchestrator, of the
        prefill / decode models it reaches by BLS in this server (`<role>_model`, no `<role>_url`).
        A model that is not here, or says nothing, does not count."""
        limits = [_int_param(config, "max_len")]
        for role in ("prefill", "decode"):
            name = _str_param(config, f"{role}_model")
            if not name or _str_param(config, f"{role}_url"):
                continue  # not an orchestrator, or that side runs in another server
            try:
                sub = await self._get_stub().ModelConfig(
                    service_pb2.ModelConfigRequest(name=name), timeout=META_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _UNREACHABLE:
                    raise
                continue  # e.g. decode_url set by environment: the model lives elsewhere
            limits.append(_int_param(sub.config, "max_len"))
        known = [n for n in limits if n is not None]
        return min(known) if known else None

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenChunk]:
        try:
            info = await self._model_info()
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, self) from None
        request = _build_request(self.model, req, info)
        call = self._get_stub().ModelStreamInfer(grpc_codec.once(request))
        done, ended = False, 0  # ended: choices with their finish reason
        try:
            async for resp in call:
                if resp.error_message:
                    done = True
                    raise _model_error(resp.error_message, self.model)
                chunk, final = _parse(resp.infer_response, time.perf_counter(), len(req.input_ids))
                # from here on the request is over: a caller that stops at this chunk must not
                # cancel the call (module docstring)
                ended += bool(chunk.finish_reason)
                done = done or ended == req.params.n or final
                if chunk.token_ids or chunk.finish_reason or chunk.prompt_logprobs:
                    yield chunk
                if ended == req.params.n or final:
                    if ended < req.params.n:
                        why = f"Triton model '{self.model}' ended the stream without a finish_reason"
                        raise APIError.of(errors.RngdPdError, why)
                    return
            done = True
            raise APIError.of(errors.RngdPdError, "Triton closed the stream before the final response")
        except grpc.aio.AioRpcError as exc:
            done = True
            raise _rpc_error(exc, self) from None
        finally:
            await grpc_codec.finish(call, done)


    async def weights(self, op: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
        """Run a weight operation on the model (pd: rngd_pd.engine.switch); its JSON answer."""
        request = grpc_codec.stream_request(self.model, op_inputs(self.model, op), (T.WEIGHTS_STATE,))
        call = self._get_stub().ModelStreamInfer(grpc_codec.once(request), timeout=timeout_s)
        try:
            async for resp in call:
                if resp.error_message:
                    raise _model_error(resp.error_message, self.model)
                outputs = grpc_codec.output_arrays(resp.infer_response)
                if T.WEIGHTS_STATE in outputs:
                    return state_of(outputs)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, self) from None
        finally:
            await grpc_codec.finish(call, True)
        raise APIError.of(errors.RngdPdError, "Triton closed the stream without the weights' state")


def _str_param(config: model_config_pb2.ModelConfig, key: str) -> str:
    return config.parameters[key].string_value.strip() if key in config.parameters else ""


def _int_param(config: model_config_pb2.ModelConfig, key: str) -> int | None:
    """A positive integer parameter; None when absent or not a positive integer."""
    text = _str_param(config, key)
    return int(text) if text.isdigit() and int(text) > 0 else None


_KEEP_DEFAULT = frozenset({T.MAX_TOKENS, T.TEMPERATURE, T.TOP_P, T.TOP_K, T.SEED, T.STOP})
"""Inputs a model may leave undeclared (it then keeps its own default); every other one asked for
must be declared, or the request is refused."""


def check_supported(model: str, params: SamplingParams, inputs: Mapping[str, str]) -> None:
    """400 naming a requested extension the Triton model declares no input for: an `ignore_eos`, an
    `n`, a `logprobs` or a structured output that the model cannot receive must not be dropped
    silently (the caller counts on the length, the choices, the logprobs, the grammar)."""
    if params.structured and T.STRUCTURED not in inputs:
        raise bad_request(
            f"structured outputs are not supported by Triton model '{model}' "
            f"(it declares no '{T.STRUCTURED}' input)",
            "response_format",
            "unsupported_parameter",
        )
    for name in sampling_values(params):
        if name not in inputs and name not in _KEEP_DEFAULT:
            param = "logit_bias" if name in (T.LOGIT_BIAS_IDS, T.LOGIT_BIAS_VALUES) else name
            raise bad_request(  # the request's parameter, and the model's input of (nearly) that name
                f"'{param}' is not supported by Triton model '{model}' (it declares no '{name}' input)",
                param,
                "unsupported_parameter",
            )


def _build_request(model: str, req: GenerateRequest, info: _ModelInfo) -> service_pb2.ModelInferRequest:
    """The streaming request for `req`: every input the model declares, in its declared datatype (an
    optional sampling input the model does not declare keeps the model's default)."""
    check_supported(model, req.params, info.inputs)
    values = {T.INPUT_IDS: req.input_ids, T.STREAM: [True], **sampling_values(req.params)}
    arrays = {name: _array(dtype, seq, info.batched)
              for name, seq in values.items() if (dtype := info.inputs.get(name)) is not None}
    out = grpc_codec.stream_request(model, arrays, request_id=req.request_id)
    if req.prefill_at:  # pd prefills this request there (rngd_pd.stubs.pd_model)
        out.parameters[PREFILLER_HEADER].string_param = req.prefill_at
    return out


def _array(dtype: str, seq: list, batched: bool) -> np.ndarray:
    """Values as the tensor the model declares: its datatype, and a batch dimension of 1 if batched."""
    if dtype == "BYTES":
        array = np.array(seq, dtype=np.object_)
    elif dtype in _NP:
        array = np.asarray(seq, dtype=_NP[dtype])
    else:
        raise APIError(502, f"unsupported Triton input datatype {dtype}", type="server_error")
    return array.reshape(1, -1) if batched else array


def _parse(resp: service_pb2.ModelInferResponse, received_at: float = 0.0,
           prompt_len: int = 0) -> tuple[TokenChunk, bool]:
    """One response -> its chunk, and whether it is the stream's last (`prompt_len`: how many rows
    the prompt's logprobs have, one per prompt token after the first)."""
    arrays: dict[str, list] = {}
    reason = None
    for out, raw in zip(resp.outputs, resp.raw_output_contents, strict=False):
        if out.name == T.FINISH_REASON:
            reason = _finish_reason(b"".join(grpc_codec.unpack_bytes(raw)[:1]).decode())
        elif out.datatype in _NP and out.datatype != "BYTES":
            arrays[out.name] = np.frombuffer(raw, dtype=_NP[out.datatype]).tolist()
    ids = tuple(arrays.get(T.OUTPUT_IDS, ()))
    token_lp = logprobs.unflatten(arrays.get(T.TOKEN_LOGPROB_IDS, []), arrays.get(T.TOKEN_LOGPROBS, []),
                                  len(ids))
    prompt_lp = logprobs.unflatten(arrays.get(T.PROMPT_LOGPROB_IDS, []),
                                   arrays.get(T.PROMPT_LOGPROB_VALUES, []), prompt_len - 1)
    chunk = TokenChunk(ids, reason, received_at, (arrays.get(T.INDEX) or [0])[0],
                       None if token_lp is None else tuple(token_lp),
                       None if prompt_lp is None else tuple(prompt_lp))
    return chunk, grpc_codec.is_final(resp)


def _finish_reason(text: str) -> FinishReason | None:
    """The reason a response gives; "" = not finished. A reason this package does not name (a model
    of someone else's) still ends the request, as the natural end OpenAI calls "stop"."""
    if not text:
        return None
    try:
        return FinishReason(text)
    except ValueError:
        return FinishReason.STOP


def _model_error(message: str, model: str) -> APIError:
    """An error response from the model, answered as `ERROR_STATUS` says for its type; where the
    serving side failed (502), the message names the model."""
    err = errors.from_wire(message)
    if answer(err) == answer(errors.RngdPdError):  # neither the request's fault nor a busy server
        message = f"Triton model '{model}' failed: {message}"
    return APIError.of(err, message)


def _rpc_error(exc: grpc.aio.AioRpcError, backend: TritonBackend) -> APIError:
    """A failed gRPC call, answered as `ERROR_STATUS` says for its status code."""
    backend._info = None  # re-read the model's metadata once Triton is back
    code, details = exc.code(), exc.details() or ""
    if code in _UNREACHABLE:
        message = f"Triton at {backend.url} is not reachable ({code.name}); retry later"
    elif "unknown model" in details or "not ready" in details or code == grpc.StatusCode.NOT_FOUND:
        code = grpc.StatusCode.NOT_FOUND  # Triton may say so in words only, under another code
        message = f"Triton model '{backend.model}' is not available: {details}"
    elif code == grpc.StatusCode.CANCELLED:
        message = f"Triton cancelled the request: {details}"
    else:
        message = f"Triton gRPC error {code.name}: {details}"
    return APIError.of(code, message)


async def wait_ready(backend: Backend, timeout: float) -> str | None:
    """Poll `ready()` until it says yes or `timeout` passes; returns the last reason (None = ready)."""
    deadline = asyncio.get_running_loop().time() + timeout
    reason = await backend.ready()
    while reason is not None and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
        reason = await backend.ready()
    return reason
