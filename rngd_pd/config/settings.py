"""Settings -> one frozen dataclass, through one shared parser: model config parameters and transport
options alike.

A settings class is a frozen dataclass whose fields carry a default, an optional environment override
and optional choices (`param(...)`). `parse_params` reads string values (Triton's
`args["model_config"]`, or a plain mapping), applies the environment overrides (they win), converts each
value to the field's type and fails with a `ConfigError` that names the owner and the setting when a
name is unknown or a value does not convert, so a typo stops a model's `initialize` instead of being
ignored. Model parameters can also be set with `RNGD_PD_PARAM_<NAME>` (`generic_env`). The variables are
entries of the one registry (rngd_pd.config.env); where each value came from stays on the returned
object (`source_of`), so a load log can say "from $RNGD_PD_DTYPE" without reading the environment again.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from rngd_pd.config.env import REGISTRY, RNGD_PD_CACHE, RNGD_PD_PARAM_, XDG_CACHE_HOME, EnvVar, parse_bool
from rngd_pd.errors import ConfigError


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """$RNGD_PD_CACHE, else $XDG_CACHE_HOME/rngd-pd, else ~/.cache/rngd-pd."""
    return RNGD_PD_CACHE.get(env) or (XDG_CACHE_HOME.get(env) or Path.home() / ".cache") / "rngd-pd"


# Parameters Triton's Python backend reads itself; allowed in any model's config.
TRITON_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})
DEFAULT = "default"  # the source of a value nobody set (`source_of`)
CODE = "code"        # the source of a value given in code (an object parse_params did not build)
_SOURCES = "_rngd_pd_sources"  # the attribute parse_params leaves on what it builds (not a field)

T = TypeVar("T")
_NO_DEFAULT: Any = object()


def param(default: Any = _NO_DEFAULT, *, env: EnvVar | None = None, choices: tuple[Any, ...] | None = None,
          help: str = "") -> Any:
    """A dataclass field for a setting: default (the variable's registry default when omitted),
    environment override (an entry of rngd_pd.config.env), allowed values."""
    if default is _NO_DEFAULT:
        if env is None:
            raise TypeError("param() needs a default or an env entry to take it from")
        default = env.default
    return dataclasses.field(default=default, metadata={"env": env.name if env else None, "choices": choices,
                                                        "help": help})


def source_of(settings: Any, field: str) -> str:
    """Where `field` of a settings object came from: "config.pbtxt", "$NAME" (an environment
    variable), "default", or "code" (set by a caller, not parsed)."""
    sources = getattr(settings, _SOURCES, None)
    if sources is None:
        return CODE
    return sources.get(field, DEFAULT)


def with_sources(settings: T, sources: Mapping[str, str]) -> T:
    """`settings` with `sources` recorded for source_of (merged over what it already records)."""
    merged = {**getattr(settings, _SOURCES, {}), **sources}
    object.__setattr__(settings, _SOURCES, merged)  # the dataclass is frozen; this is not a field
    return settings


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
    sources: dict[str, str] = {}
    for name, f in fields.items():
        text, source = raw.get(name), "config.pbtxt"
        named = f.metadata.get("env")
        overrides = ((param_env(name), RNGD_PD_PARAM_.raw(env, name)) if generic_env else (None, None),
                     (named, REGISTRY[named].raw(env)) if named else (None, None))
        for env_name, value in overrides:
            if value is not None:
                text, source = value, f"${env_name}"
        if text is None:
            continue
        sources[name] = source
        values[name] = _convert(text, hints[name], f"{where}parameter {name!r} from {source}")
        choices = f.metadata.get("choices")
        if choices and values[name] not in choices:
            raise ConfigError(
                f"{where}parameter {name!r} from {source} is {text!r}; choose one of {', '.join(choices)}"
            )
    try:
        return with_sources(cls(**values), sources)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}{exc}") from exc


def param_env(name: str) -> str:
    """The generic environment override of parameter `name` (`RNGD_PD_PARAM_MAX_LEN`)."""
    return RNGD_PD_PARAM_.member(name)


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
            return parse_bool(text)
        return hint(text)
    except ValueError:
        name = getattr(hint, "__name__", str(hint))
        raise ConfigError(f"{what} is {text!r}, which is not a valid {name}") from None


