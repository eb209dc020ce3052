"""Model config parameters -> one frozen dataclass, through one shared parser.

Every model declares its parameters as a frozen dataclass whose fields carry a default, an optional
environment override and optional choices (`param(...)`). `parse_params` reads Triton's
`args["model_config"]`, converts each value to the field's type and fails with a `ConfigError` that
names the model and the parameter when a name is unknown or a value does not convert, so a typo in
config.pbtxt stops `initialize` instead of being ignored.

Environment overrides (set by `rngd-pd serve` and by ai-rm) win over config.pbtxt: `RNGD_PD_MODEL`
(model path), `AIRM_KV_TRANSPORT` (transport name), `RNGD_PD_KV_DTYPE` (KV wire dtype),
`RNGD_PD_DTYPE` (compute dtype), and for `pd`
`RNGD_PD_PREFILL_URL` / `RNGD_PD_DECODE_URL` (remote prefill/decode servers, gRPC host:port).
Any parameter can also be set with `RNGD_PD_PARAM_<NAME>` (`RNGD_PD_PARAM_MAX_LEN=512`), in every model
that has it; a named override above wins over it. `rngd-pd serve --param NAME=VALUE` sets these.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rngd_pd.errors import ConfigError

ENV_MODEL = "RNGD_PD_MODEL"
ENV_KV_TRANSPORT = "AIRM_KV_TRANSPORT"
ENV_KV_DTYPE = "RNGD_PD_KV_DTYPE"
ENV_DTYPE = "RNGD_PD_DTYPE"
ENV_PREFILL_URL = "RNGD_PD_PREFILL_URL"  # pd: reach prefill by gRPC in another tritonserver
ENV_DECODE_URL = "RNGD_PD_DECODE_URL"    # pd: reach decode by gRPC in another tritonserver
ENV_PARAM_PREFIX = "RNGD_PD_PARAM_"      # RNGD_PD_PARAM_<NAME>: override parameter <name> anywhere

KV_DTYPES = ("bf16", "fp16", "fp32")
COMPUTE_DTYPES = ("auto", "bf16", "fp32")  # auto: rngd_pd.devices.cpu_features.choose_compute_dtype
DEVICES = ("cpu", "cuda", "rngd", "atom")

# Parameters Triton's Python backend reads itself; allowed in any model's config.
TRITON_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})

T = TypeVar("T")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def param(default: Any, *, env: str | None = None, choices: tuple[Any, ...] | None = None,
          help: str = "") -> Any:
    """A dataclass field for a model parameter: default, environment override, allowed values."""
    return dataclasses.field(default=default, metadata={"env": env, "choices": choices, "help": help})


@dataclass(frozen=True)
class ServingParams:
    """Parameters every serving model shares; models subclass it and add their own."""

    device: str = param("cpu", choices=DEVICES, help="where the instances run")
    device_ids: tuple[int, ...] = param((-1,), help="-1 = the allocated card; else one id per instance")
    torch_threads: int = param(0, help="torch intra-op threads per instance (0 = leave torch's default)")
    model_path: str | None = param(None, env=ENV_MODEL, help="checkpoint dir or .gguf; empty = embedded")
    kv_transport: str = param("shm", env=ENV_KV_TRANSPORT, help="airm.kv_transports name")
    kv_dtype: str = param("bf16", env=ENV_KV_DTYPE, choices=KV_DTYPES, help="KV wire dtype")
    dtype: str = param("auto", env=ENV_DTYPE, choices=COMPUTE_DTYPES,
                       help="compute dtype: auto (bf16 where the CPU/GPU computes bf16 natively, else fp32), "
                            "bf16 (serving speed) or fp32 (bit-exact with the fp32 oracle)")

    def device_id_for(self, instance: int) -> int:
        """The device id of instance number `instance` (one id for all, or one per instance)."""
        if len(self.device_ids) == 1:
            return self.device_ids[0]
        if instance >= len(self.device_ids):
            raise ConfigError(
                f"device_ids has {len(self.device_ids)} entries but instance {instance} needs one; "
                "give one id per instance (count in instance_group) or a single id"
            )
        return self.device_ids[instance]


def raw_parameters(model_config: str | Mapping[str, Any]) -> dict[str, str]:
    """`{name: string_value}` from Triton's model_config (JSON string or dict) or a plain mapping."""
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    if "parameters" in config:
        params = config["parameters"]
    elif "name" in config or "input" in config:  # a whole model config without parameters
        params = {}
    else:  # a plain {name: value} mapping
        params = config
    out: dict[str, str] = {}
    for name, value in (params or {}).items():
        out[name] = value.get("string_value", "") if isinstance(value, Mapping) else str(value)
    return out


def parse_params(cls: type[T], model_config: str | Mapping[str, Any], *,
                 env: Mapping[str, str] | None = None, model: str | None = None) -> T:
    """Build `cls` from config parameters + environment overrides; ConfigError names the culprit."""
    env = os.environ if env is None else env
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    if model is None and isinstance(config.get("name"), str):
        model = config["name"]
    where = f"model {model!r}: " if model else ""
    raw = raw_parameters(config)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields) - TRITON_PARAMETERS)
    if unknown:
        raise ConfigError(
            f"{where}unknown parameter(s) {', '.join(unknown)} in config.pbtxt; "
            f"known parameters: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        text, source = raw.get(name), "config.pbtxt"
        for env_name in (param_env(name), f.metadata.get("env")):
            if env_name and env.get(env_name, "") != "":
                text, source = env[env_name], f"${env_name}"
        if text is None:
            continue
        values[name] = _convert(text, hints[name], f"{where}parameter {name!r} from {source}")
        choices = f.metadata.get("choices")
        if choices and values[name] not in choices:
            raise ConfigError(
                f"{where}parameter {name!r} from {source} is {text!r}; choose one of {', '.join(choices)}"
            )
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}{exc}") from exc


def param_env(name: str) -> str:
    """The generic environment override of parameter `name` (`RNGD_PD_PARAM_MAX_LEN`)."""
    return ENV_PARAM_PREFIX + name.upper()


def _convert(text: str, hint: Any, what: str) -> Any:
    """Convert one string value to the annotated type (str, int, float, bool, tuple[...], X | None)."""
    text = text.strip()
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if text == "" or text.lower() == "none":
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        items = [s for s in re.split(r"[,\s]+", text.strip("[]")) if s]
        return tuple(_convert(s, args[0], what) for s in items)
    try:
        if hint is bool:
            low = text.lower()
            if low in _TRUE | _FALSE:
                return low in _TRUE
            raise ValueError(text)
        return hint(text)
    except ValueError:
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{what} is {text!r}, which is not a valid {name}") from None


def describe(params: Any) -> str:
    """One line `name=value ...` for the model's load log."""
    return " ".join(f"{f.name}={getattr(params, f.name)!r}" for f in dataclasses.fields(params))


def instance_index(instance_name: str) -> int:
    """Index of an instance within its group from Triton's `model_instance_name` (`pd_0_1` -> 1)."""
    match = re.search(r"_(\d+)$", instance_name or "")
    return int(match.group(1)) if match else 0


def kv_torch_dtype(name: str) -> Any:
    """torch dtype of a KV dtype name (bf16, fp16, fp32)."""
    import torch

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in table:
        raise ConfigError(f"kv_dtype {name!r} is not one of {', '.join(KV_DTYPES)}")
    return table[name]
