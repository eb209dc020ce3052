"""KV events configuration, read the way vLLM reads it: one JSON object with the keys of vLLM's
`KVEventsConfig` (`vllm/config/kv_events.py`), from `rngd-pd serve --kv-events-config JSON` or
`$RNGD_PD_KV_EVENTS_CONFIG` (serve passes the flag to the models as that variable).

Off by default. `publisher` defaults to "zmq" when `enable_kv_cache_events` is true, else "null",
as in vLLM. An unknown key, a wrong type or a bad endpoint is a `ConfigError` naming it, so a typo
stops the model's load (or `serve`) instead of silently publishing nothing. Stdlib only: serve reads it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rngd_pd.config.env import RNGD_PD_KV_EVENTS_CONFIG
from rngd_pd.errors import ConfigError

PUBLISHERS = ("null", "zmq")
SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys and defaults (vLLM 0.32)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (vLLM's __post_init__)
    endpoint: str = "tcp://*:5557"  # PUB: bound when wildcard or ipc/inproc, else connected to
    replay_endpoint: str | None = None  # ROUTER for replay, always bound; None = no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the sender thread; beyond, the oldest drops
    topic: str = ""  # llm-d: kv@<pod-ip>@<model>

    @property
    def enabled(self) -> bool:
        """Whether events are published at all (enabled and a real publisher)."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"

    @property
    def resolved_publisher(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind wildcard (`*`, `::`) and ipc/inproc endpoints, connect to
    any other (in llm-d's global-socket mode the indexer binds and every engine connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def parse(text: str | Mapping[str, Any] | None, source: str = "--kv-events-config") -> KVEventsConfig:
    """A KVEventsConfig from a JSON object (text or mapping); empty or None gives the default (off)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return KVEventsConfig()
    if isinstance(text, str):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source} is not JSON: {exc}") from None
    else:
        data = dict(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    for name, value in data.items():
        _check_type(source, name, value, KVEventsConfig.__dataclass_fields__[name].default)
    cfg = KVEventsConfig(**data)
    _check_values(source, cfg)
    return cfg


def from_env(env: Mapping[str, str] | None = None) -> KVEventsConfig:
    """The configuration in $RNGD_PD_KV_EVENTS_CONFIG (the default, off, when unset)."""
    return parse(RNGD_PD_KV_EVENTS_CONFIG.get(env), source=f"${RNGD_PD_KV_EVENTS_CONFIG.name}")


def _check_type(source: str, name: str, value: Any, default: Any) -> None:
    if name in ("publisher", "replay_endpoint") and value is None:
        return
    want: type = type(default) if default is not None else str
    ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{source}: {name} must be a {want.__name__}, got {value!r}")


def _check_values(source: str, cfg: KVEventsConfig) -> None:
    if cfg.resolved_publisher not in PUBLISHERS:
        raise ConfigError(f"{source}: publisher must be one of {', '.join(PUBLISHERS)}, "
                          f"got {cfg.publisher!r}")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(cfg, name)
        if value is not None and not value.startswith(SCHEMES):
            raise ConfigError(f"{source}: {name} {value!r} must start with one of {', '.join(SCHEMES)}")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{source}: {name} must be >= 1, got {getattr(cfg, name)}")
