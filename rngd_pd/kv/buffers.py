"""Zero-copy byte views of tensors and arrays, the checksum functions both sides share, and the
eviction rule of the size-keyed pools of reusable buffers (relay buffers, shm slots).

Transports work on flat byte `memoryview`s. These helpers turn whatever the engine holds (a torch CPU
tensor of any dtype including bf16, a numpy array, bytes) into such a view without copying, and
refuse what cannot be viewed that way (non-contiguous, on a device, read-only where writing is needed).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, MutableMapping
from typing import Any

import crc32c as _crc32c
import xxhash

from rngd_pd.errors import TransportError

CHECKSUMS: dict[str, Callable[[Any], int]] = {
    "crc32c": _crc32c.crc32c,  # hardware CRC-32C, ~15 GB/s: the default
    "crc32": zlib.crc32,  # the original's CRC-32 (zlib), ~4 GB/s
    "xxh3": xxhash.xxh3_64_intdigest,  # ~26 GB/s, 64-bit
}
DEFAULT_CHECKSUM = "crc32c"


def checksum(data: Any, algorithm: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of a buffer with the named algorithm (see CHECKSUMS)."""
    try:
        fn = CHECKSUMS[algorithm]
    except KeyError:
        raise TransportError(
            f"unknown checksum algorithm {algorithm!r}; known: {', '.join(sorted(CHECKSUMS))}"
        ) from None
    return fn(data)


def _torch_view(x: Any) -> memoryview:
    if x.device.type != "cpu":
        raise TransportError(f"tensor is on {x.device}; copy it to host memory before a transport")
    if not x.is_contiguous():
        raise TransportError("tensor is not contiguous; call .contiguous() first")
    import torch

    flat = x.reshape(-1).view(torch.uint8)  # bf16 etc. -> uint8 without a copy (numpy has no bf16)
    return memoryview(flat.numpy())


def as_bytes(data: Any) -> memoryview:
    """A flat read-only-or-writable byte view of `data` (bytes, bytearray, memoryview, numpy, torch)."""
    if type(data).__module__.startswith("torch"):
        return _torch_view(data)
    try:
        mv = memoryview(data)
    except TypeError:
        raise TransportError(f"cannot view a {type(data).__name__} as bytes") from None
    if not mv.c_contiguous:
        raise TransportError("buffer is not C-contiguous; make a contiguous copy first")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def as_writable_bytes(out: Any) -> memoryview:
    """Like as_bytes, but the caller's buffer must be writable (pull copies into it)."""
    mv = as_bytes(out)
    if mv.readonly:
        raise TransportError(f"output buffer ({type(out).__name__}) is read-only; pass a writable one")
    return mv


def make_room(pool: MutableMapping[int, list], size: int, held: int, cap: int,
              drop: Callable[[Any], None] = lambda item: None) -> tuple[int, bool]:
    """Room for one more item of `size` bytes in a pool of idle items keyed by size, capped at `cap`
    bytes in all: items of other sizes are given up (`drop`), oldest size first, so the pool follows
    the sizes in use instead of pinning old ones (which made every new-size buffer fault fresh pages).
    Returns the bytes still held and whether the item fits."""
    if size > cap:
        return held, False
    while held + size > cap:
        other = next((s for s, items in pool.items() if s != size and items), None)
        if other is None:
            return held, False  # full of items of this very size already
        drop(pool[other].pop())
        held -= other
    return held, True
