"""Each transport's options as one frozen dataclass, read once through the shared settings parser.

Sources, weakest first: the field's default, the model's `kv_options` parameter (config.pbtxt, e.g.
`addr=relay.kv:9100;crc=0`), the original's environment variables (`AIRM_KV_TCP_ADDR`, `PD_SHM_ROOT`,
..., kept so ai-rm deployments work unchanged; their defaults are in rngd_pd.config.env), then values a
caller passes in code. A bad value is a ConfigError naming the option and where it came from, before
any connection or file is made. nixl-ucx's `ttl_s` is `AIRM_KV_TCP_TTL_S`, the relay's: its arena slots
have expired on that variable since its first version, and the original has no UCX name for it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rngd_pd.config.env import (
    AIRM_KV_SHM_CRC,
    AIRM_KV_SHM_POOL_MB,
    AIRM_KV_SHM_TTL_S,
    AIRM_KV_TCP_ADDR,
    AIRM_KV_TCP_CRC,
    AIRM_KV_TCP_LOG,
    AIRM_KV_TCP_SECRET,
    AIRM_KV_TCP_TTL_S,
    AIRM_KV_UCX_LOG,
    AIRM_KV_UCX_POOL_MB,
    AIRM_KV_UCX_READ_AHEAD,
    FALSE,
    PD_SHM_ROOT,
)
from rngd_pd.config.settings import CODE, param, parse_params, source_of, with_sources
from rngd_pd.errors import ConfigError, TransportConfigError

Opts = TypeVar("Opts")


@dataclass(frozen=True)
class ShmOptions:
    root: str | None = param(env=PD_SHM_ROOT, help="directory of the shared slots (/dev/shm/rngd-pd)")
    ttl_s: float = param(env=AIRM_KV_SHM_TTL_S, help="seconds an unreleased key lives")
    crc: bool = param(env=AIRM_KV_SHM_CRC, help="checksum every blob on both sides")
    pool_mb: int = param(env=AIRM_KV_SHM_POOL_MB, help="idle slot memory kept for reuse")


@dataclass(frozen=True)
class RelayOptions:
    addr: str | None = param(env=AIRM_KV_TCP_ADDR, help="host:port of the KV relay")
    secret: str | None = param(env=AIRM_KV_TCP_SECRET, help="the relay's shared secret (HMAC)")
    crc: str = param(env=AIRM_KV_TCP_CRC, help="crc32c, crc32 (the original's) or 0 (none)")
    log_blobs: bool = param(env=AIRM_KV_TCP_LOG, help="log each blob's SHA-256")


@dataclass(frozen=True)
class UcxOptions(RelayOptions):
    log_blobs: bool = param(env=AIRM_KV_UCX_LOG, help="log each blob's SHA-256")
    ttl_s: float = param(env=AIRM_KV_TCP_TTL_S, help="seconds an unread arena slot lives (the relay's TTL "
                                                    "variable: module docstring)")
    pool_mb: int = param(env=AIRM_KV_UCX_POOL_MB, help="registered arena per process")
    read_ahead: int = param(env=AIRM_KV_UCX_READ_AHEAD, help="descriptor GETs in flight per pull")


def parse_kv_options(text: str) -> dict[str, str]:
    """`addr=host:9100;crc=0` (`;` or `,` between pairs) -> {name: value}."""
    out = {}
    for item in (s.strip() for s in re.split(r"[;,]", text or "")):
        if item:
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"kv_options takes NAME=VALUE pairs separated by ';', got {item!r}")
            out[name.strip()] = value.strip()
    return out


def options(cls: type[Opts], name: str, config: Mapping[str, str] | str | None = None,
            **given: Any) -> Opts:
    """`cls` for transport `name` from config values and the environment, then the non-None `given`."""
    try:
        values = parse_kv_options(config) if isinstance(config, str) else dict(config or {})
        parsed = parse_params(cls, values, generic_env=False, where=f"KV transport {name!r} option")
    except ConfigError as exc:
        raise TransportConfigError(str(exc)) from None
    given = {k: v for k, v in given.items() if v is not None}
    sources = {f.name: source_of(parsed, f.name) for f in dataclasses.fields(parsed)}  # type: ignore[arg-type]
    return with_sources(dataclasses.replace(parsed, **given), {**sources, **dict.fromkeys(given, CODE)})


def at_least(opts: Any, name: str, **minimums: float) -> None:
    """TransportConfigError naming the option and its environment variable when one is below its minimum."""
    for field in dataclasses.fields(opts):
        least = minimums.get(field.name)
        value = getattr(opts, field.name)
        if least is not None and value < least:
            env = field.metadata.get("env")
            where = f"{field.name} (${env})" if env else field.name
            raise TransportConfigError(f"KV transport {name!r} option {where} must be >= {least:g}, "
                                       f"got {value!r}")


def crc_algorithm(value: str | bool | None) -> str | None:
    """The checksum a relay client uses: None (off), "crc32" or "crc32c"."""
    if value is None or value is False:
        return None
    text = "crc32c" if value is True else str(value).strip().lower()
    if text in FALSE | {"none", ""}:
        return None
    return "crc32" if text == "crc32" else "crc32c"
