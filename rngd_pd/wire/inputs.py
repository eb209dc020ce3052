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
    input of that name is not read (prefill samples one token, whatever the request asks; a
    min_tokens above it counts as that many: the first token may not end the request)."""
    values: dict[str, object] = {}
    requested = _scalar(get, T.MAX_TOKENS) if max_tokens is None else max_tokens
    if requested is None:
        raise errors.ConfigError(f"input {T.MAX_TOKENS!r} is required (INT32 [1], at least 1)")
    for name, cast in _SCALARS:
        value = requested if name == T.MAX_TOKENS else _scalar(get, name)
        if value is not None:
            values[name] = cast(value)
    stop = get(T.STOP)
    if stop is not None and stop.size:
        values["stop"] = tuple(s.decode("utf-8") if isinstance(s, bytes) else str(s)
                               for s in stop.reshape(-1) if s not in (b"", ""))
    if _scalar(get, T.IGNORE_EOS):
        values["ignore_eos"] = True
    structured = _scalar(get, T.STRUCTURED)
    if structured:
        values["structured"] = structured
    stop_ids = get(T.STOP_TOKEN_IDS)
    if stop_ids is not None and stop_ids.size:
        values["stop_token_ids"] = tuple(int(t) for t in stop_ids.reshape(-1))
    bias_ids, biases = get(T.LOGIT_BIAS_IDS), get(T.LOGIT_BIAS_VALUES)
    if bias_ids is not None and bias_ids.size:
        if biases is None or biases.size != bias_ids.size:
            raise errors.ConfigError(f"inputs {T.LOGIT_BIAS_IDS!r} and {T.LOGIT_BIAS_VALUES!r} must have "
                                     "the same number of elements")
        values["logit_bias"] = tuple((int(t), float(b)) for t, b in
                                     zip(bias_ids.reshape(-1), biases.reshape(-1), strict=True))
    for name in (T.LOGPROBS, T.PROMPT_LOGPROBS):  # -1 on the wire: none asked for (as if absent)
        if values.get(name, 0) < 0:  # type: ignore[operator]
            del values[name]
    if max_tokens is not None and T.MIN_TOKENS in values:  # prefill's one token: banned or not is all
        values[T.MIN_TOKENS] = min(int(values[T.MIN_TOKENS]), max_tokens)  # type: ignore[call-overload]
    return SamplingParams(**values)  # type: ignore[arg-type]


# scalar inputs -> the SamplingParams field of the same name, and how to read it
_SCALARS: tuple[tuple[str, Callable[[object], object]], ...] = (
    (T.MAX_TOKENS, int), (T.TEMPERATURE, float), (T.TOP_P, float), (T.TOP_K, int), (T.SEED, int),
    (T.N, int), (T.LOGPROBS, int), (T.PROMPT_LOGPROBS, int), (T.PRESENCE_PENALTY, float),
    (T.FREQUENCY_PENALTY, float), (T.REPETITION_PENALTY, float), (T.MIN_TOKENS, int),
)


def sampling_values(params: SamplingParams, *, with_max_tokens: bool = True) -> dict[str, list]:
    """The values of the inputs that carry `params` to a model, by input name: temperature, top_p and
    top_k always, the others only when set or when they differ from their defaults (texts as UTF-8
    bytes, logit_bias as ids and biases)."""
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
    defaults = _DEFAULTS
    for name in (T.N, T.LOGPROBS, T.PROMPT_LOGPROBS, T.PRESENCE_PENALTY, T.FREQUENCY_PENALTY,
                 T.REPETITION_PENALTY, T.MIN_TOKENS):
        value = getattr(params, name)
        if value != getattr(defaults, name):
            out[name] = [value]
    if params.logit_bias:
        out[T.LOGIT_BIAS_IDS] = [t for t, _ in params.logit_bias]
        out[T.LOGIT_BIAS_VALUES] = [b for _, b in params.logit_bias]
    if params.stop_token_ids:
        out[T.STOP_TOKEN_IDS] = list(params.stop_token_ids)
    return out


_DEFAULTS = SamplingParams()


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
