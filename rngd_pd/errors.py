"""One small error hierarchy for the whole package.

Every error carries the request key where there is one, so a log line or a Triton error response can
name the request it belongs to. Messages say what happened and what to do about it.

A handed-over exception (one thread catches it and queues it, another raises it) is raised as
`try: raise exc` / `finally: del exc`, and a log call is given `str(exc)`, not the exception: no
frame may end up in a cycle with a traceback, which in a stub would keep the request's Triton objects
and the model from unloading (docs/architecture.md, "Why it is built this way").
"""

from __future__ import annotations

import re


class RngdPdError(Exception):
    """Base of every error this package raises on purpose."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    @property
    def message(self) -> str:
        """The message without the request key."""
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return f"[request {self.key}] {self.message}" if self.key else self.message


class ConfigError(RngdPdError, ValueError):
    """A bad parameter value (request or model configuration)."""


class ContextLengthError(ConfigError):
    """Prompt length plus max_tokens exceeds the model's (or bucket's) context."""


class ModelLoadError(RngdPdError):
    """A model path that does not exist, or a corrupt / unsupported checkpoint."""


class DeviceUnavailableError(RngdPdError):
    """The requested device's SDK or card is missing."""


class CapacityError(RngdPdError):
    """A bounded queue or pool is full; retry later or raise the limit."""


class RequestCancelled(RngdPdError):
    """The client cancelled the request."""


class TransportError(RngdPdError):
    """A KV transfer failed. Never answered by falling back to another transport."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A blob did not arrive within the given timeout (or the peer died)."""


class TransportIntegrityError(TransportError):
    """A blob's size, checksum or handle does not match what the receiver expects."""


class TransportConfigError(TransportError, ConfigError):
    """A transport option (config.pbtxt's kv_options or its environment variable) is bad."""


class TransportCapacityError(TransportError):
    """The transport's storage (/dev/shm, relay memory cap, NIXL arena) is full."""


# ---------------------------------------------------------------- across Triton hops
#
# Triton 2.51 delivers every error of a BLS call as INTERNAL with only its message, and gRPC clients get
# a status code and a message too; so an error's type and request key travel inside the message, in one
# format written and read only here:  "TypeName: [request KEY] message".

_WIRE = re.compile(r"(?:^|\s)([A-Z][A-Za-z]*(?:Error|Cancelled)): (?:\[request ([^\]\s]+)\] )?(.*)", re.S)


def to_wire(exc: BaseException) -> str:
    """The message that carries `exc` through Triton (see `from_wire`)."""
    key = getattr(exc, "key", None)
    message = exc.message if isinstance(exc, RngdPdError) else str(exc)
    return f"{type(exc).__name__}: " + (f"[request {key}] " if key else "") + message


def from_wire(text: str, default: type[RngdPdError] = RngdPdError) -> RngdPdError:
    """Our exception back from a message `to_wire` wrote, wherever Triton put it in its own text (an
    ensemble or a gRPC status may prefix it); an unknown or missing type keeps the whole text in
    `default`."""
    match = _WIRE.search(text.strip())
    if match:
        cls = globals().get(match.group(1))
        if isinstance(cls, type) and issubclass(cls, RngdPdError):
            return cls(match.group(3), key=match.group(2))
    return default(text.strip())
