"""The one importer of `triton_python_backend_utils`: thin helpers to read inputs, build responses and
turn our errors into Triton error responses.

`triton_python_backend_utils` exists only inside a Triton Python-backend stub process, so it is
imported once here and everything else asks this module. Outside Triton `import rngd_pd.stubs.pbutils`
still works (tests, tooling); calling a helper that needs Triton raises a RuntimeError that says so.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np

from rngd_pd import errors
from rngd_pd.wire.tensors import ModelSpec, TensorSpec

try:  # present only inside the Python backend's stub process
    import triton_python_backend_utils as _pb  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the process we run in
    _pb = None


def pb() -> Any:
    """The `triton_python_backend_utils` module; RuntimeError outside Triton."""
    if _pb is None:
        raise RuntimeError(
            "triton_python_backend_utils is only importable inside a Triton Python-backend model; "
            "run this code from a model.py served by tritonserver"
        )
    return _pb


# ---------------------------------------------------------------- reading inputs


def input_array(request: Any, name: str) -> np.ndarray | None:
    """The input tensor `name` as numpy, or None when the client did not send it."""
    tensor = pb().get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value.item() if isinstance(value, np.generic) else value


def request_parameter(request: Any, name: str) -> str | None:
    """A request parameter's value as a string (Triton gives them as one JSON object), or None."""
    try:
        value = json.loads(request.parameters() or "{}").get(name)
    except (ValueError, AttributeError):
        return None
    return None if value is None else str(value)


def input_scalar(request: Any, name: str, default: Any = None) -> Any:
    """First element of input `name` as a Python value (BYTES -> str), or `default` when absent."""
    array = input_array(request, name)
    if array is None or array.size == 0:
        return default
    return _decode(array.reshape(-1)[0])


def input_strings(request: Any, name: str) -> list[str]:
    """All elements of a BYTES input as str (an absent input is an empty list)."""
    array = input_array(request, name)
    return [] if array is None else [_decode(v) for v in array.reshape(-1)]


def input_ids(request: Any, name: str) -> list[int]:
    """An integer input as a flat list of ints; ConfigError when it is missing."""
    array = input_array(request, name)
    if array is None:
        raise errors.ConfigError(f"input {name!r} is required")
    return array.reshape(-1).astype(np.int64).tolist()


# ---------------------------------------------------------------- building responses


def to_array(spec: TensorSpec, value: Any) -> np.ndarray:
    """`value` as a numpy array of the spec's dtype (str/bytes for BYTES, scalars become [1])."""
    if spec.dtype == "BYTES":
        items = [value] if isinstance(value, str | bytes) else list(value)
        return np.array([v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in items],
                        dtype=np.object_)
    array = np.asarray(value, dtype=spec.numpy_dtype)
    return array.reshape(1) if array.ndim == 0 else array


def make_tensor(spec: TensorSpec, value: Any) -> Any:
    """A `pb_utils.Tensor` for `spec` holding `value`."""
    return pb().Tensor(spec.name, to_array(spec, value))


def requested_outputs(request: Any) -> frozenset[str]:
    """The outputs the receiver of `request`'s responses asked for (all of them when it named none).

    Why it matters: Triton 2.51 prunes every other tensor of a response in C++ after releasing the GIL,
    and freeing the pruned numpy array there corrupts the stub's heap under concurrency (python_backend
    #390, fixed only in r24.12). So a response never carries a tensor outside this set.
    """
    return frozenset(request.requested_output_names())


def make_response(spec: ModelSpec, outputs: Mapping[str, Any], requested: Collection[str]) -> Any:
    """An InferenceResponse with the `requested` ones of `outputs` ({name: value}), typed by the spec.

    The one place responses are built: a value whose name the receiver did not request is never turned
    into a tensor (see `requested_outputs`). A callable value is computed only when requested.
    """
    tensors = [make_tensor(spec.output(name), value() if callable(value) else value)
               for name, value in outputs.items() if name in requested]
    return pb().InferenceResponse(output_tensors=tensors)


_CODES: Sequence[tuple[type[BaseException], str]] = (
    (errors.RequestCancelled, "CANCELLED"),
    (errors.ConfigError, "INVALID_ARG"),
    (errors.CapacityError, "UNAVAILABLE"),
    (errors.DeviceUnavailableError, "UNAVAILABLE"),
    (errors.TransportError, "INTERNAL"),
)


def error_code(exc: BaseException) -> str:
    """Triton error code name for an exception (bad input -> INVALID_ARG, full -> UNAVAILABLE, ...)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return "INTERNAL"


def error_message(exc: BaseException) -> str:
    """The error's type, request key and message in one string (`errors.to_wire`), so a client (and pd
    after a BLS hop, where 2.51 makes every error INTERNAL) can tell a transport failure from a bad
    parameter."""
    return errors.to_wire(exc)


def triton_error(exc: BaseException) -> Any:
    """A `pb_utils.TritonError` for `exc` with the matching code."""
    err = pb().TritonError
    return err(error_message(exc), getattr(err, error_code(exc), err.INTERNAL))


def error_response(exc: BaseException) -> Any:
    """An InferenceResponse that carries only the error for `exc`."""
    return pb().InferenceResponse(output_tensors=[], error=triton_error(exc))


# ---------------------------------------------------------------- decoupled helpers


def final_flag() -> int:
    """TRITONSERVER_RESPONSE_COMPLETE_FINAL."""
    return pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL


def send(sender: Any, response: Any | None = None, *, final: bool = False) -> None:
    """Send one response on a decoupled sender; `final` closes the request (response may be None)."""
    if final:
        sender.send(response, flags=final_flag())
    else:
        sender.send(response)


def send_error(sender: Any, exc: BaseException) -> None:
    """Fail a decoupled request: its one final response is the error."""
    sender.send(error_response(exc), flags=final_flag())


# ---------------------------------------------------------------- metrics and logging


def metric_family(name: str, description: str, kind: str) -> Any:
    """A `pb_utils.MetricFamily` of kind COUNTER, GAUGE or HISTOGRAM."""
    family = pb().MetricFamily
    return family(name=name, description=description, kind=getattr(family, kind))


def log(message: str, level: str = "info") -> None:
    """Write to Triton's log (info, warn, error, verbose); print outside Triton."""
    if _pb is None:
        print(message)
        return
    logger = _pb.Logger
    {"info": logger.log_info, "warn": logger.log_warn, "error": logger.log_error,
     "verbose": logger.log_verbose}.get(level, logger.log_info)(message)
