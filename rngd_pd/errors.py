"""One small error hierarchy for the whole package.

Every error carries the request key where there is one, so a log line or a Triton error response can
name the request it belongs to. Messages say what happened and what to do about it.
"""

from __future__ import annotations


class RngdPdError(Exception):
    """Base of every error this package raises on purpose."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __str__(self) -> str:
        msg = super().__str__()
        prefix = f"[request {self.key}] "
        return msg if not self.key or msg.startswith(prefix) else prefix + msg  # once, after a hop too


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


class TransportCapacityError(TransportError):
    """The transport's storage (/dev/shm, relay memory cap, NIXL arena) is full."""
