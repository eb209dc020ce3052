"""Request inputs <-> Python values, shared by every model that samples and by the orchestrator.

Sampling inputs arrive as optional Triton tensors; `sampling_params` turns whatever was sent into one
validated `SamplingParams` (a bad value is a ConfigError naming the input), and `sampling_inputs` turns it
back into tensors for the next hop (pd -> prefill / decode), so the three models read the same thing.
Errors that crossed Triton as text come back as our own exception types through `errors.from_wire`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np

from rngd_pd import errors
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.wire import tensors as T

Getter = Callable[[str], "np.ndarray | None"]


def new_key() -> str:
    """A request key unique across processes and hosts (it names the KV blobs on the transport)."""
    return uuid.uuid4().hex


def _scalar(get: Getter, name: str) -> object | None:
    array = get(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def sampling_params(get: Getter, *, require_max_tokens: bool = True) -> SamplingParams:
    """SamplingParams from optional tensors (`get(name)` returns the numpy array or None); validated."""
    values: dict[str, object] = {}
    max_tokens = _scalar(get, T.MAX_TOKENS)
    if max_tokens is None and require_max_tokens:
        raise errors.ConfigError(f"input {T.MAX_TOKENS!r} is required (INT32 [1], at least 1)")
    for name, cast in ((T.MAX_TOKENS, int), (T.TEMPERATURE, float), (T.TOP_P, float), (T.TOP_K, int),
                       (T.SEED, int)):
        value = max_tokens if name == T.MAX_TOKENS else _scalar(get, name)
        if value is not None:
            values[name] = cast(value)  # type: ignore[operator]
    stop = get(T.STOP)
    if stop is not None and stop.size:
        values["stop"] = tuple(s.decode("utf-8") if isinstance(s, bytes) else str(s)
                               for s in stop.reshape(-1) if s not in (b"", ""))
    if _scalar(get, T.IGNORE_EOS):
        values["ignore_eos"] = True
    params = SamplingParams(**values)  # type: ignore[arg-type]
    params.validate()
    return params


def sampling_inputs(params: SamplingParams, *, with_max_tokens: bool = True) -> dict[str, np.ndarray]:
    """The tensors that carry `params` to another model (only what differs from the defaults)."""
    out: dict[str, np.ndarray] = {}
    if with_max_tokens:
        out[T.MAX_TOKENS] = np.array([params.max_tokens], np.int32)
    out[T.TEMPERATURE] = np.array([params.temperature], np.float32)
    out[T.TOP_P] = np.array([params.top_p], np.float32)
    out[T.TOP_K] = np.array([params.top_k], np.int32)
    if params.seed is not None:
        out[T.SEED] = np.array([params.seed], np.uint64)
    if params.ignore_eos:
        out[T.IGNORE_EOS] = np.array([True])
    if params.stop:
        out[T.STOP] = np.array([s.encode("utf-8") for s in params.stop], dtype=np.object_)
    return out


def token_ids(get: Getter, name: str = T.INPUT_IDS) -> list[int]:
    """A required 1-D id tensor as ints; ConfigError when it is missing or empty."""
    array = get(name)
    if array is None or array.size == 0:
        raise errors.ConfigError(f"input {name!r} is required and must hold at least one token id")
    return array.reshape(-1).astype(np.int64).tolist()


def bytes_scalar(value: object) -> str:
    """A BYTES element as str (numpy object arrays hold bytes)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
