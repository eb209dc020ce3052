"""Settings -> one frozen dataclass, through one shared parser: model config parameters and transport
options alike.

A settings class is a frozen dataclass whose fields carry a default, an optional environment override
and optional choices (`param(...)`). `parse_params` reads string values (Triton's
`args["model_config"]`, or a plain mapping), applies the environment overrides (they win), converts each
value to the field's type and fails with a `ConfigError` that names the owner and the setting when a
name is unknown or a value does not convert, so a typo stops a model's `initialize` instead of being
ignored. Model parameters can also be set with `RNGD_PD_PARAM_<NAME>` (`generic_env`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from rngd_pd.errors import ConfigError

ENV_CACHE = "RNGD_PD_CACHE"  # where the Triton backend links and the kernel measurements live


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """$RNGD_PD_CACHE, else $XDG_CACHE_HOME/rngd-pd, else ~/.cache/rngd-pd."""
    env = os.environ if env is None else env
    if env.get(ENV_CACHE):
        return Path(env[ENV_CACHE])
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rngd-pd"


ENV_PARAM_PREFIX = "RNGD_PD_PARAM_"  # RNGD_PD_PARAM_<NAME>: override model parameter <name> anywhere
# Parameters Triton's Python backend reads itself; allowed in any model's config.
TRITON_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})

T = TypeVar("T")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def param(default: Any, *, env: str | None = None, choices: tuple[Any, ...] | None = None,
          help: str = "") -> Any:
    """A dataclass field for a setting: default, environment override, allowed values."""
    return dataclasses.field(default=default, metadata={"env": env, "choices": choices, "help": help})


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
                 env: Mapping[str, str] | None = None, model: str | None = None,
                 generic_env: bool = True, where: str | None = None) -> T:
    """Build `cls` from config parameters + environment overrides; ConfigError names the culprit
    (`where`, else the model). `generic_env` also reads `RNGD_PD_PARAM_<NAME>`."""
    env = os.environ if env is None else env
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    if model is None and isinstance(config.get("name"), str):
        model = config["name"]
    where = f"{where}: " if where else f"model {model!r}: " if model else ""
    raw = raw_parameters(config)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields) - TRITON_PARAMETERS)
    if unknown:
        raise ConfigError(
            f"{where}unknown parameter(s) {', '.join(unknown)}; "
            f"known parameters: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        text, source = raw.get(name), "config.pbtxt"
        for env_name in (param_env(name) if generic_env else None, f.metadata.get("env")):
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


