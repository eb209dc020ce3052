"""Transports by name: entry-point group `airm.kv_transports`, imported only when asked for.

Resolution order for a name: `rm_core.registry.load` when rm_core is importable (ai-rm's registry),
otherwise the installed entry points (`importlib.metadata`). `shm` also resolves from the source tree
alone (package not installed, only rngd_pd on PYTHONPATH), as pods that mount the code do. A name that
resolves nowhere is a `KeyError` listing the known names; nothing falls back to another transport.

Serving (`rngd-pd serve`, the prefill and decode models, ai-rm's runner) takes only the names
`require_servable` accepts: a registered transport that nothing in serving can drive is refused there
with the reason and what to use instead, before any server starts or any model loads.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable
from typing import Any

from rngd_pd.config.env import AIRM_KV_TRANSPORT
from rngd_pd.errors import ConfigError
from rngd_pd.kv.fenced import FencedTransport, is_copy_only
from rngd_pd.kv.protocol import Transport

GROUP = "airm.kv_transports"
# Found without any installed metadata (only the source tree on the path).
BUILTIN: dict[str, str] = {"shm": "rngd_pd.kv.shm.transport:ShmTransport"}

# Registered, loadable (its own tests, library callers), but refused by serving: name -> why and what
# to use instead.
NOT_SERVING: dict[str, str] = {
    "nixl": "it copies only between allocations its caller binds first (NixlTransport.bind), which "
            "neither the prefill nor the decode model does, and its fenced bytes stay in one process; "
            "serve KV over NIXL with `nixl-ucx` (or use shm, tcp)",
}

_lock = threading.Lock()
_cache: dict[str, Callable[..., Any]] = {}


def _import(target: str) -> Callable[..., Any]:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def known_names() -> list[str]:
    """Every name that can resolve here: installed entry points plus the built-in ones."""
    return sorted(set(_entry_points()) | set(BUILTIN))


def serving_names() -> list[str]:
    """The known names serving accepts."""
    return [name for name in known_names() if name not in NOT_SERVING]


def require_servable(name: str) -> str:
    """`name` when serving can use it; ConfigError saying why not and naming the alternative
    otherwise (an unknown name too, listing the serving names). Cheap: imports no transport."""
    if name in NOT_SERVING:
        raise ConfigError(f"KV transport {name!r} cannot serve: {NOT_SERVING[name]}")
    if name not in known_names():
        raise ConfigError(f"unknown KV transport {name!r}; serving takes: {', '.join(serving_names())}")
    return name


def _resolve(name: str) -> Callable[..., Any]:
    try:
        from rm_core import registry as rm_registry  # ai-rm's registry, when installed
    except ImportError:
        rm_registry = None
    if rm_registry is not None:
        try:
            return rm_registry.load(GROUP, name)
        except (KeyError, LookupError):
            pass  # rm_core does not know it: try our own entry points and built-ins below
    eps = _entry_points()
    if name in eps:
        return eps[name].load()
    if name in BUILTIN:
        return _import(BUILTIN[name])
    raise KeyError(
        f"unknown KV transport {name!r}; known: {', '.join(known_names())} "
        f"(entry-point group {GROUP}; set {AIRM_KV_TRANSPORT.name} or pass a name)"
    )


def transport_class(name: str) -> Callable[..., Any]:
    """The factory (usually a class) registered under `name`, looked up once per process."""
    with _lock:
        if name not in _cache:
            _cache[name] = _resolve(name)
        return _cache[name]


def load_transport(name: str | None = None, **options: Any) -> Transport:
    """Build the transport `name` (default: $AIRM_KV_TRANSPORT, else "shm") with `options`.

    A registered object that is already a transport instance is returned as it is; a copy-only
    transport (plan/submit/wait) comes wrapped in `FencedTransport`.
    """
    name = name or AIRM_KV_TRANSPORT.get()
    obj = transport_class(name)
    if isinstance(obj, type) or not (hasattr(obj, "push") or hasattr(obj, "plan")):
        obj = obj(**options)

    return FencedTransport(obj) if is_copy_only(obj) else obj
