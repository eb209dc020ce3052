"""Triton's gRPC stream protocol with grpc.aio and the protobufs themselves, for every caller here.

Both callers of Triton's `ModelStreamInfer` (the OpenAI front end, and pd reaching decode) build the
protobufs directly: the empty final response can be requested and no per-token helper objects are
made. Two Triton 2.51 facts every caller must respect live here once:

* After a request's final response the call is never cancelled nor dropped: `finish` waits (at most
  `STATUS_WAIT_S`) for the status Triton sends once the stream is done. A call cancelled or dropped
  there, before its status, makes Triton 2.51's stream handler keep the request's state for good
  (triton-inference-server/server#8078), and with it the model, which can then never unload.
* A call cancelled while its request runs is fine: Triton turns it into a cancelled request.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Iterable, Mapping

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from rngd_pd.wire.tensors import NUMPY_DTYPES

STATUS_WAIT_S = 5.0  # after the final response, how long the stream's status may take
# reconnect within 2 s of Triton coming back (gRPC's default back-off grows to 120 s, which kept a
# restarted server unreachable long after it was ready); messages as large as Triton allows
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 2**30), ("grpc.max_receive_message_length", 2**30),
                   ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]

NP_DTYPES = {k: v for k, v in NUMPY_DTYPES.items() if k != "BYTES"}  # the ones sent as raw numbers
_TRITON_DTYPES = {np.dtype(v): k for k, v in NP_DTYPES.items()}


def pack_bytes(items: Iterable[str | bytes]) -> bytes:
    """A BYTES tensor's raw contents: each element as a little-endian uint32 length, then its bytes."""
    parts = [s.encode() if isinstance(s, str) else bytes(s) for s in items]
    return b"".join(struct.pack("<I", len(b)) + b for b in parts)


def unpack_bytes(raw: bytes) -> list[bytes]:
    """The elements of a BYTES tensor's raw contents."""
    out, at = [], 0
    while at + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4:at + 4 + n])
        at += 4 + n
    return out


def triton_dtype(array: np.ndarray) -> str:
    """Triton's datatype name for an array (object and bytes arrays are BYTES)."""
    if array.dtype == np.object_ or array.dtype.kind in "SU":
        return "BYTES"
    try:
        return _TRITON_DTYPES[array.dtype]
    except KeyError:
        raise TypeError(f"no Triton datatype for numpy {array.dtype} (use one of "
                        f"{', '.join(str(np.dtype(t)) for t in NP_DTYPES.values())} or bytes)") from None


def add_input(request: service_pb2.ModelInferRequest, name: str, array: np.ndarray) -> None:
    """Append one input tensor (shape and raw contents) to `request`."""
    dtype = triton_dtype(array)
    tensor = request.inputs.add(name=name, datatype=dtype)
    tensor.shape.extend(array.shape)
    if dtype == "BYTES":
        request.raw_input_contents.append(pack_bytes(array.reshape(-1).tolist()))
    else:
        request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())


def stream_request(model: str, inputs: Mapping[str, np.ndarray], outputs: Iterable[str] = (),
                   request_id: str = "") -> service_pb2.ModelInferRequest:
    """A request for a decoupled model that asks for the empty final response (so a stream always
    ends with a response flagged final) and exactly `outputs` (all the model's when empty)."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, array in inputs.items():
        add_input(request, name, np.asarray(array))
    for name in outputs:
        request.outputs.add(name=name)
    return request


def output_arrays(response: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    """The response's tensors as arrays of their own (BYTES ones as object arrays of bytes)."""
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents, strict=False):
        shape = tuple(tensor.shape)
        if tensor.datatype == "BYTES":
            out[tensor.name] = np.array(unpack_bytes(raw), dtype=np.object_).reshape(shape)
        elif tensor.datatype in NP_DTYPES:
            out[tensor.name] = np.frombuffer(raw, dtype=NP_DTYPES[tensor.datatype]).reshape(shape).copy()
        else:
            raise TypeError(f"unsupported Triton output datatype {tensor.datatype} ({tensor.name})")
    return out


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    """Whether Triton flagged this response as the request's last."""
    params = response.parameters
    return params["triton_final_response"].bool_param if "triton_final_response" in params else False


async def once(request: service_pb2.ModelInferRequest) -> AsyncIterator[service_pb2.ModelInferRequest]:
    """The request side of a stream carrying one request (then half-closed; responses still come)."""
    yield request


async def finish(call: grpc.aio.StreamStreamCall, done: bool) -> None:
    """End a call: a finished one (`done`) with Triton's status, a running one by cancelling it
    (module docstring)."""
    if not done:
        call.cancel()
        return
    try:
        await asyncio.wait_for(call.code(), STATUS_WAIT_S)
    except (TimeoutError, grpc.aio.AioRpcError):
        call.cancel()
