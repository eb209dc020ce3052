"""Request inputs <-> Python values, shared by every model that samples and by the orchestrator.

Sampling inputs arrive as optional Triton tensors; `sampling_params` turns whatever was sent into one
`SamplingParams` (the edge of a stub: a bad value is a ConfigError naming the input), and
`sampling_values` is the one encoder back: the values that carry it to a model, by input name. It feeds
`sampling_inputs` (numpy arrays in the dtypes of `rngd_pd.wire.tensors`, for pd's next hop to prefill /
decode) and the front end (which sends each value in the dtype its Triton model declares), so every
model reads the same thing. Errors that crossed Triton as text come back as our own exception types
through `errors.from_wire`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import numpy as np

from rngd_pd import errors
from rngd_pd.model.params import SamplingParams
from rngd_pd.wire import tensors as T

Getter = Callable[[str], "np.ndarray | None"]
_DTYPES = {t.name: t.numpy_dtype for t in T.GENERATION_INPUTS}  # what sampling_inputs sends


def new_key() -> str:
    """A request key unique across processes and hosts (it names the KV blobs on the transport)."""
    return uuid.uuid4().hex


def _scalar(get: Getter, name: str) -> object | None:
    array = get(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def sampling_params(get: Getter, *, max_tokens: int | None = None) -> SamplingParams:
    """SamplingParams from optional tensors (`get(name)` returns the numpy array or None); building it
    checks it (ConfigError naming the bad input). `max_tokens` given: that many, and the required
    input of that name is not read (prefill samples one token, whatever the request asks)."""
    values: dict[str, object] = {}
    requested = _scalar(get, T.MAX_TOKENS) if max_tokens is None else max_tokens
    if requested is None:
        raise errors.ConfigError(f"input {T.MAX_TOKENS!r} is required (INT32 [1], at least 1)")
    for name, cast in ((T.MAX_TOKENS, int), (T.TEMPERATURE, float), (T.TOP_P, float), (T.TOP_K, int),
                       (T.SEED, int)):
        value = requested if name == T.MAX_TOKENS else _scalar(get, name)
        if value is not None:
            values[name] = cast(value)  # type: ignore[operator]
    stop = get(T.STOP)
    if stop is not None and stop.size:
        values["stop"] = tuple(s.decode("utf-8") if isinstance(s, bytes) else str(s)
                               for s in stop.reshape(-1) if s not in (b"", ""))
    if _scalar(get, T.IGNORE_EOS):
        values["ignore_eos"] = True
    structured = _scalar(get, T.STRUCTURED)
    if structured:
        values["structured"] = structured
    return SamplingParams(**values)  # type: ignore[arg-type]


def sampling_values(params: SamplingParams, *, with_max_tokens: bool = True) -> dict[str, list]:
    """The values of the inputs that carry `params` to a model, by input name: temperature, top_p and
    top_k always, seed, ignore_eos, stop and structured only when set (texts as UTF-8 bytes)."""
    out: dict[str, list] = {}
    if with_max_tokens:
        out[T.MAX_TOKENS] = [params.max_tokens]
    out[T.TEMPERATURE] = [params.temperature]
    out[T.TOP_P] = [params.top_p]
    out[T.TOP_K] = [params.top_k]
    if params.seed is not None:
        out[T.SEED] = [params.seed]
    if params.ignore_eos:
        out[T.IGNORE_EOS] = [True]
    if params.stop:
        out[T.STOP] = [s.encode("utf-8") for s in params.stop]
    if params.structured:
        out[T.STRUCTURED] = [params.structured.encode("utf-8")]
    return out


def sampling_inputs(params: SamplingParams, *, with_max_tokens: bool = True) -> dict[str, np.ndarray]:
    """`sampling_values` as the tensors our models declare (`rngd_pd.wire.tensors`' dtypes)."""
    return {name: np.array(values, _DTYPES[name])
            for name, values in sampling_values(params, with_max_tokens=with_max_tokens).items()}


def token_ids(get: Getter, name: str = T.INPUT_IDS) -> list[int]:
    """A required 1-D id tensor as ints; ConfigError when it is missing or empty."""
    array = get(name)
    if array is None or array.size == 0:
        raise errors.ConfigError(f"input {name!r} is required and must hold at least one token id")
    return array.reshape(-1).astype(np.int64).tolist()


def bytes_scalar(value: object) -> str:
    """A BYTES element as str (numpy object arrays hold bytes)."""
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
