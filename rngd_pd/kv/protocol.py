"""The one interface every KV transport implements, blob by blob.

A request's KV moves as `2 * num_layers` blobs (index `2*i` = layer i's K, `2*i+1` = its V) plus the
KV handle at index `2 * num_layers`, pushed last. The prefill side pushes each blob as soon as its layer
exists; the decode side pulls them in order into buffers it preallocated, then releases the key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeAlias, runtime_checkable

# What push accepts and pull fills: anything exposing a C-contiguous byte buffer (bytes, bytearray,
# memoryview, numpy arrays, torch CPU tensors of any dtype). See rngd_pd.kv.buffers.as_bytes.
Buffer: TypeAlias = Any


@runtime_checkable
class Transport(Protocol):
    """Moves opaque byte blobs from one process to another under (key, index).

    Thread-safety: every method may be called from several threads of one process at once (the
    prefill engine pushes from its layer hook while other requests pull); implementations serialise
    internally where they must.

    Errors (all from `rngd_pd.errors`): `TransportTimeoutError` when a blob did not appear in time
    (also what a dead peer looks like), `TransportIntegrityError` for a size or checksum mismatch,
    `TransportCapacityError` when the storage is full, `TransportError` for anything else (a relay
    that went away, a bad key). A transport never falls back to another path.
    """

    name: str

    def push(self, key: str, index: int, data: Buffer) -> None:
        """Store `data` as blob `index` of request `key`.

        Called by the prefill side, once per blob, typically from the model's per-layer hook. Blocks
        until the bytes are owned by the transport: the caller may overwrite `data` on return. The
        blob becomes visible to `pull` only complete, never partially. Pushing the same (key, index)
        again replaces it.

        A transport may return before its storage acknowledged the blob (tcp pipelines its PUTs);
        such a transport also has `flush(key)`, which returns once every blob pushed for `key` is
        stored and raises the first error that came back meanwhile. Callers that need to know a
        request's KV is safely out (prefill, before it answers) call `flush` when it exists.
        """
        ...

    def pull(self, key: str, index: int, out: Buffer, timeout: float) -> int:
        """Copy blob `index` of `key` into the caller's writable, preallocated `out`; return its size.

        Called by the decode side. Blocks until the blob exists (it may be pushed after this call
        starts) or `timeout` seconds pass (`TransportTimeoutError`). `out` must be at least the
        blob's size (`TransportIntegrityError` otherwise); bytes past the blob are left untouched.
        Pulling does not remove the blob: `release` does.
        """
        ...

    def release(self, key: str) -> None:
        """Free everything stored under `key`. Idempotent; unknown keys are not an error.

        Called by the decode side once it holds the KV (or by whoever abandons a request). Blobs
        nobody releases expire after the transport's TTL.
        """
        ...

    def close(self) -> None:
        """Free this object's resources (connections, pools, arenas). Idempotent."""
        ...


def flush(transport: Any, key: str) -> None:
    """`transport.flush(key)` where the transport has it (pushes that may return before the blob is
    stored); a no-op for the others."""
    fn = getattr(transport, "flush", None)
    if fn is not None:
        fn(key)


class Closing:
    """`with transport:` closes it on exit; shared by the transports and the relay client."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CopyTransport(Protocol):
    """A copy-only transport between memory tiers (plan/submit/wait), e.g. NIXL HETERO_NPU.

    It cannot store blobs by key; `rngd_pd.kv.fenced.FencedTransport` adapts it to `Transport`.
    """

    name: str

    def plan(self, key: str, index: int, src: Buffer, dst: Buffer | None = None) -> Any:
        """Prepare one copy and return an opaque plan. Refuses an unsupported route here, not later."""
        ...

    def submit(self, plan: Any) -> None:
        """Start the copy; returns without waiting for it."""
        ...

    def wait(self, plan: Any, timeout: float) -> bool:
        """The completion fence: True once every command of the copy completed without error."""
        ...

    def close(self) -> None:
        """Free the agent and its registrations."""
        ...


@dataclass
class ConformanceCase:
    """How the conformance suite drives one transport (from its `conformance_case()` classmethod).

    A transport class may define `conformance_case(cls) -> ContextManager[ConformanceCase]`: entering it
    sets up what the transport needs (a scratch directory, a relay), leaving it tears that down. The
    hooks let the suite reach into the transport's storage; a hook left None skips its case.
    """

    options: dict[str, Any] = field(default_factory=dict)  # load_transport(**options), both processes
    env: dict[str, str] = field(default_factory=dict)  # environment for the child processes
    ttl_s: float | None = None  # with ttl_options, blobs expire after about this long
    ttl_options: dict[str, Any] | None = None
    # corrupt(transport, key, index, data): store `data` under (key, index) corrupted the way this
    # transport's storage or wire can be; may raise TransportIntegrityError itself (checked on the way in)
    corrupt: Callable[[Any, str, int, bytes], None] | None = None
    stored_blobs: Callable[[str], int] | None = None  # blobs held under a key (0 after release/TTL)
    stored_bytes: Callable[[], int] | None = None  # bytes held for unreleased blobs, all keys
