"""Tensor names, data types and dims of every model in the repository: the one definition.

`model.py` files, the orchestrator, the front end and the tests all take names from here, and
`check_config` compares a `config.pbtxt` (ensemble maps included) against it, so a name restated in
a config cannot drift from the code that reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Names shared by several models.
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
INPUT_IDS = "input_ids"
OUTPUT_IDS = "output_ids"
FINISH_REASON = "finish_reason"
MAX_TOKENS = "max_tokens"
STREAM = "stream"
TEMPERATURE = "temperature"
TOP_P = "top_p"
TOP_K = "top_k"
SEED = "seed"
STOP = "stop"
IGNORE_EOS = "ignore_eos"
STRUCTURED = "structured"  # JSON text of rngd_pd.model.structured.Structured: the reply's grammar
# OpenAI's and vLLM's extensions (rngd_pd.model.params.SamplingParams); logit_bias travels as two
# parallel tensors (ids, biases)
N = "n"
LOGPROBS = "logprobs"
PROMPT_LOGPROBS = "prompt_logprobs"
PRESENCE_PENALTY = "presence_penalty"
FREQUENCY_PENALTY = "frequency_penalty"
REPETITION_PENALTY = "repetition_penalty"
LOGIT_BIAS_IDS = "logit_bias_ids"
LOGIT_BIAS_VALUES = "logit_bias_values"
MIN_TOKENS = "min_tokens"
STOP_TOKEN_IDS = "stop_token_ids"
# Outputs beside output_ids. Logprobs cross Triton as tensors: for each id of the response a row of
# width 1 + k (k = the request's `logprobs`): the chosen token and its top-k alternatives, ids in
# TOKEN_LOGPROB_IDS, log-probabilities in TOKEN_LOGPROBS (empty when the request asked for none).
# The prompt's the same way (row i: prompt token i + 1, from the logits of position i), on the first
# response. INDEX is the choice (of n) a response belongs to.
TOKEN_LOGPROB_IDS = "token_logprob_ids"
TOKEN_LOGPROBS = "token_logprobs"
PROMPT_LOGPROB_IDS = "prompt_logprob_ids"
PROMPT_LOGPROB_VALUES = "prompt_logprob_values"
INDEX = "index"
FIRST_TOKENS = "first_tokens"  # prefill -> pd: the first token of each of n choices
PROMPT_IDS = "prompt_ids"  # pd -> decode: the prompt, when the repetition penalty needs it
REQUEST_KEY = "request_key"
PROMPT_LEN = "prompt_len"
FIRST_TOKEN = "first_token"
KV_HANDLE = "kv_handle"
# pd -> prefill: compute this prompt head's KV into prefill's prefix cache only, no token, no hand-off
# (a long prompt goes as several requests, others between them: rngd_pd.engine.prefill_queue);
# CACHED_TOKENS answers how many of its tokens the cache holds (0: no prefix cache there).
CACHE_ONLY = "cache_only"
CACHED_TOKENS = "cached_tokens"
CANCEL = "cancel"
# Conditional disaggregation: pd asks decode once for the prompt length up to which decode prefills
# itself (DESCRIBE -> LOCAL_PREFILL_TOKENS), then sends such prompts' INPUT_IDS to decode directly.
DESCRIBE = "describe"
LOCAL_PREFILL_TOKENS = "local_prefill_tokens"
APPLY_CHAT_TEMPLATE = "apply_chat_template"
CONTEXT_IDS = "context_ids"  # pd -> postprocess: the ids before this chunk, for streaming-safe text
# Errors in band inside the llm ensemble: preprocess asks pd for them (ERRORS_IN_BAND, always true),
# and pd then ends a failed request with a normal final response whose ERROR carries the error
# (`errors.to_wire`, "" on every other response); postprocess turns it back into an error response.
# A pd error response while postprocess still works on earlier tokens left 2.51's ensemble request open.
ERRORS_IN_BAND = "errors_in_band"
ERROR = "error"
# Weight updates while serving (rngd_pd.engine.switch): a request whose WEIGHTS_OP carries a JSON
# operation (stage, commit, abort, state; on pd: apply_delta, state) is answered with WEIGHTS_STATE
# (JSON) instead of tokens; the other required inputs of such a request are ignored.
WEIGHTS_OP = "weights_op"
WEIGHTS_STATE = "weights_state"

# Triton data type -> numpy, the one table (the stubs' tensors, the gRPC codec, the front end).
NUMPY_DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT64": np.uint64,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: Triton data type (without TYPE_), dims (-1 = variable), optional."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype a `pb_utils.Tensor` of this spec carries (BYTES -> object)."""
        return np.dtype(NUMPY_DTYPES[self.dtype])

    @property
    def config_dtype(self) -> str:
        """The spelling in config.pbtxt (`TYPE_INT32`; BYTES is `TYPE_STRING` there)."""
        return "TYPE_STRING" if self.dtype == "BYTES" else f"TYPE_{self.dtype}"


@dataclass(frozen=True)
class ModelSpec:
    """A model's interface as clients and the other models see it."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    decoupled: bool = False
    doc: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        # Each name once: an identical repeat (a spec extended twice) collapses, a conflicting one fails.
        for side in ("inputs", "outputs"):
            unique: dict[str, TensorSpec] = {}
            for t in getattr(self, side):
                if unique.setdefault(t.name, t) != t:
                    raise ValueError(f"model {self.name!r}: {t.name!r} is defined twice, differently")
            object.__setattr__(self, side, tuple(unique.values()))

    def input(self, name: str) -> TensorSpec:
        return _find(self.name, "input", self.inputs, name)

    def output(self, name: str) -> TensorSpec:
        return _find(self.name, "output", self.outputs, name)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


def _find(model: str, kind: str, specs: Iterable[TensorSpec], name: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    known = ", ".join(s.name for s in specs)
    raise KeyError(f"model {model!r} has no {kind} {name!r}; its {kind}s are: {known}")


def _t(name: str, dtype: str, *dims: int, optional: bool = False) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(dims), optional)


# Sampling inputs shared by llm, pd, colocated, decode and prefill (every one that samples).
SAMPLER_INPUTS: tuple[TensorSpec, ...] = (
    _t(TEMPERATURE, "FP32", 1, optional=True),
    _t(TOP_P, "FP32", 1, optional=True),
    _t(TOP_K, "INT32", 1, optional=True),
    _t(SEED, "UINT64", 1, optional=True),
    _t(IGNORE_EOS, "BOOL", 1, optional=True),  # benchmarks: run to max_tokens past EOS
    _t(STRUCTURED, "BYTES", 1, optional=True),  # structured outputs: sampled where tokens are chosen
    _t(N, "INT32", 1, optional=True),
    _t(LOGPROBS, "INT32", 1, optional=True),
    _t(PROMPT_LOGPROBS, "INT32", 1, optional=True),
    _t(PRESENCE_PENALTY, "FP32", 1, optional=True),
    _t(FREQUENCY_PENALTY, "FP32", 1, optional=True),
    _t(REPETITION_PENALTY, "FP32", 1, optional=True),
    _t(LOGIT_BIAS_IDS, "INT32", -1, optional=True),
    _t(LOGIT_BIAS_VALUES, "FP32", -1, optional=True),
    _t(MIN_TOKENS, "INT32", 1, optional=True),
    _t(STOP_TOKEN_IDS, "INT32", -1, optional=True),
)
SAMPLING_INPUTS: tuple[TensorSpec, ...] = (*SAMPLER_INPUTS, _t(STOP, "BYTES", -1, optional=True))
GENERATION_INPUTS: tuple[TensorSpec, ...] = (
    _t(MAX_TOKENS, "INT32", 1),
    _t(STREAM, "BOOL", 1, optional=True),
    *SAMPLING_INPUTS,
)
TOKEN_OUTPUTS: tuple[TensorSpec, ...] = (
    _t(OUTPUT_IDS, "INT32", -1),
    _t(FINISH_REASON, "BYTES", 1),
)
LOGPROB_OUTPUTS: tuple[TensorSpec, ...] = (
    _t(INDEX, "INT32", 1),
    _t(TOKEN_LOGPROB_IDS, "INT32", -1),
    _t(TOKEN_LOGPROBS, "FP32", -1),
    _t(PROMPT_LOGPROB_IDS, "INT32", -1),
    _t(PROMPT_LOGPROB_VALUES, "FP32", -1),
)

LLM = ModelSpec(
    "llm",
    (_t(TEXT_INPUT, "BYTES", 1), *GENERATION_INPUTS),
    (_t(TEXT_OUTPUT, "BYTES", 1), *TOKEN_OUTPUTS, *LOGPROB_OUTPUTS),
    decoupled=True,
    doc="ensemble preprocess -> pd -> postprocess; the model clients call",
)
PD = ModelSpec(
    "pd",
    (_t(INPUT_IDS, "INT32", -1), *GENERATION_INPUTS, _t(ERRORS_IN_BAND, "BOOL", 1, optional=True),
     _t(WEIGHTS_OP, "BYTES", 1, optional=True)),
    # context_ids, stop (the request's stop strings, echoed) and error are for the stateless postprocess
    # of the llm ensemble: a step may not mix inputs from a decoupled model and the ensemble's own inputs
    (*TOKEN_OUTPUTS, _t(CONTEXT_IDS, "INT32", -1), _t(STOP, "BYTES", -1), _t(ERROR, "BYTES", 1),
     _t(WEIGHTS_STATE, "BYTES", 1), *LOGPROB_OUTPUTS),
    decoupled=True,
    doc="BLS orchestrator: prefill + decode of one request, streams tokens",
)
COLOCATED = ModelSpec(
    "colocated",
    PD.inputs,
    PD.outputs,
    decoupled=True,
    doc="prefill and decode in one instance, no transfer; same interface as pd",
)
PREPROCESS = ModelSpec(
    "preprocess",
    (_t(TEXT_INPUT, "BYTES", 1), _t(APPLY_CHAT_TEMPLATE, "BOOL", 1, optional=True)),
    (_t(INPUT_IDS, "INT32", -1), _t(ERRORS_IN_BAND, "BOOL", 1)),
    doc="text -> token ids",
)
PREFILL = ModelSpec(
    "prefill",
    (_t(REQUEST_KEY, "BYTES", 1), _t(INPUT_IDS, "INT32", -1), *SAMPLER_INPUTS,
     _t(WEIGHTS_OP, "BYTES", 1, optional=True), _t(CACHE_ONLY, "BOOL", 1, optional=True)),
    (_t(FIRST_TOKEN, "INT32", 1), _t(KV_HANDLE, "BYTES", 1), _t(WEIGHTS_STATE, "BYTES", 1),
     _t(FIRST_TOKENS, "INT32", -1), _t(TOKEN_LOGPROB_IDS, "INT32", -1), _t(TOKEN_LOGPROBS, "FP32", -1),
     _t(PROMPT_LOGPROB_IDS, "INT32", -1), _t(PROMPT_LOGPROB_VALUES, "FP32", -1),
     _t(CACHED_TOKENS, "INT32", 1)),
    doc="token ids -> first token; pushes each layer's KV through the transport",
)
DECODE = ModelSpec(
    "decode",
    (
        _t(REQUEST_KEY, "BYTES", 1),
        _t(PROMPT_LEN, "INT32", 1, optional=True),
        _t(MAX_TOKENS, "INT32", 1, optional=True),
        *SAMPLING_INPUTS,
        _t(CANCEL, "BOOL", 1, optional=True),
        _t(INPUT_IDS, "INT32", -1, optional=True),
        _t(DESCRIBE, "BOOL", 1, optional=True),
        _t(WEIGHTS_OP, "BYTES", 1, optional=True),
        _t(PROMPT_IDS, "INT32", -1, optional=True),
    ),
    (*TOKEN_OUTPUTS, _t(LOCAL_PREFILL_TOKENS, "INT32", 1), _t(WEIGHTS_STATE, "BYTES", 1), *LOGPROB_OUTPUTS),
    decoupled=True,
    doc="request key -> token stream; pulls the KV by key (cancel=true stops a key; input_ids: "
        "prefill here, no hand-off; describe=true: the local prefill threshold)",
)
POSTPROCESS = ModelSpec(
    "postprocess",
    (*TOKEN_OUTPUTS, _t(CONTEXT_IDS, "INT32", -1, optional=True), _t(STOP, "BYTES", -1, optional=True),
     _t(ERROR, "BYTES", 1, optional=True), *(_t(t.name, t.dtype, *t.dims, optional=True)
                                             for t in LOGPROB_OUTPUTS)),
    (_t(TEXT_OUTPUT, "BYTES", 1), *TOKEN_OUTPUTS, *LOGPROB_OUTPUTS),
    doc="token ids -> text",
)

MODELS: dict[str, ModelSpec] = {
    m.name: m for m in (LLM, PD, COLOCATED, PREPROCESS, PREFILL, DECODE, POSTPROCESS)
}


def model_spec(name: str) -> ModelSpec:
    """The spec of model `name`; KeyError listing the known models."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"no tensor spec for model {name!r}; known: {', '.join(MODELS)}") from None


def load_config(path: str | Path) -> Any:
    """Parse a config.pbtxt into Triton's `ModelConfig` protobuf (from tritonclient)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def _dtype_name(enum_value: int) -> str:
    from tritonclient.grpc import model_config_pb2

    name = model_config_pb2.DataType.Name(enum_value).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def check_config(config: Any, spec: ModelSpec | None = None) -> list[str]:
    """Problems of a parsed config against its spec (empty list = consistent).

    Checks every input/output name, data type, dims and `optional`, the decoupled policy, and for an
    ensemble that each step's maps use real tensors of the step's model.
    """
    spec = spec or model_spec(config.name)
    where = f"{spec.name}/config.pbtxt"
    problems = _check_side(where, "input", config.input, spec.inputs)
    problems += _check_side(where, "output", config.output, spec.outputs)
    decoupled = bool(config.model_transaction_policy.decoupled)
    if config.platform != "ensemble" and decoupled != spec.decoupled:
        problems.append(f"{where}: decoupled is {decoupled}, the spec says {spec.decoupled}")
    if config.platform == "ensemble":
        problems += _check_ensemble(where, config)
    return problems


def _check_side(where: str, kind: str, got: Iterable[Any], want: tuple[TensorSpec, ...]) -> list[str]:
    problems: list[str] = []
    got_by_name = {t.name: t for t in got}
    for spec in want:
        t = got_by_name.pop(spec.name, None)
        if t is None:
            problems.append(f"{where}: {kind} {spec.name!r} is missing")
            continue
        if _dtype_name(t.data_type) != spec.dtype:
            problems.append(f"{where}: {kind} {spec.name!r} is {_dtype_name(t.data_type)}, not {spec.dtype}")
        if tuple(t.dims) != spec.dims:
            problems.append(f"{where}: {kind} {spec.name!r} has dims {list(t.dims)}, not {list(spec.dims)}")
        if kind == "input" and bool(t.optional) != spec.optional:
            problems.append(f"{where}: input {spec.name!r} optional={t.optional}, not {spec.optional}")
    problems += [f"{where}: {kind} {name!r} is not in rngd_pd.wire.tensors" for name in got_by_name]
    return problems


def _check_ensemble(where: str, config: Any) -> list[str]:
    problems: list[str] = []
    for step in config.ensemble_scheduling.step:
        if step.model_name not in MODELS:
            problems.append(f"{where}: step model {step.model_name!r} has no tensor spec")
            continue
        inner = MODELS[step.model_name]
        for name in step.input_map:
            if name not in inner.input_names:
                problems.append(f"{where}: step {step.model_name} maps unknown input {name!r}")
        for name in step.output_map:
            if name not in inner.output_names:
                problems.append(f"{where}: step {step.model_name} maps unknown output {name!r}")
    return problems
