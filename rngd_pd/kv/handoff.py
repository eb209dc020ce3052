"""Both ends of one request's KV hand-off over a `Transport`: blobs per layer, then the handle.

`KVSender` is prefill's `on_layer` hook: it pushes layer i's K and V the moment they exist (so the
transfer overlaps layers i+1..) and checksums them; `finish` pushes the sealed `KVHandle` (with the
first token) last. `KVReceiver` is decode's side: it pulls the blobs in order into buffers it sized
from the prompt length, then the handle, validates the handle against its own model (fingerprint,
dtype, geometry) and every blob's size and checksum, and only then hands the KV to the engine.

Every transport failure is re-raised with the transport's name in the message. Debug hook: with
`RNGD_PD_KV_DEBUG_LOG=<file>` both sides append one JSON line per blob (side, key, index, nbytes,
crc32c of the bytes that side holds), computed independently, so a test can compare them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rngd_pd import errors
from rngd_pd.config.dtypes import torch_dtype
from rngd_pd.config.env import RNGD_PD_KV_DEBUG_LOG
from rngd_pd.kv.buffers import DEFAULT_CHECKSUM, as_bytes, checksum
from rngd_pd.kv.handle import KVHandle, KVSpec, handle_index, k_index, v_index
from rngd_pd.kv.protocol import flush

HANDLE_MAX_BYTES = 1 << 20
_log_lock = threading.Lock()


def debug_log(side: str, key: str, index: int, data: Any) -> None:
    """Append one blob's checksum to $RNGD_PD_KV_DEBUG_LOG (no-op when unset)."""
    path = RNGD_PD_KV_DEBUG_LOG.get()
    if not path:
        return
    view = as_bytes(data)
    line = json.dumps({"side": side, "key": key, "index": index, "nbytes": len(view),
                       "crc32c": checksum(view, "crc32c")})
    with _log_lock, open(path, "a") as f:
        f.write(line + "\n")


def _named(transport: Any, exc: errors.TransportError, key: str, what: str) -> errors.TransportError:
    """The same error type, its message prefixed with the transport's name and what we were doing."""
    name = getattr(transport, "name", type(transport).__name__)
    return type(exc)(f"KV transport {name!r} failed to {what}: {exc.message}", key=key)


class KVSender:
    """Pushes one request's blobs from prefill's per-layer hook; `finish` pushes the handle last."""

    def __init__(self, transport: Any, key: str, spec: KVSpec,
                 to_host: Callable[[Any], Any] = lambda t: t) -> None:
        self.transport, self.key, self.spec, self.to_host = transport, key, spec, to_host
        self.sizes = [0] * (2 * spec.num_layers)
        self.checksums = [0] * (2 * spec.num_layers)
        self.push_s = 0.0

    def on_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for index, tensor in ((k_index(layer), k), (v_index(layer), v)):
            self._push(index, self.to_host(tensor).contiguous())  # a GPU's K/V is copied down here

    def _push(self, index: int, data: Any) -> None:
        view = as_bytes(data)
        t0 = time.perf_counter()
        try:
            self.transport.push(self.key, index, data)
        except errors.TransportError as exc:
            raise _named(self.transport, exc, self.key, f"push blob {index}") from exc
        self.push_s += time.perf_counter() - t0
        if index < len(self.sizes):
            self.sizes[index] = len(view)
            self.checksums[index] = checksum(view, "crc32c")
        debug_log("prefill", self.key, index, view)

    def finish(self, first_token: int, num_tokens: int, first_tokens: Sequence[int] = ()) -> KVHandle:
        """Seal and push the handle (the decode side's signal that every blob is there);
        first_tokens: each choice's of a request with n > 1."""
        s = self.spec
        handle = KVHandle(key=self.key, transport=getattr(self.transport, "name", "?"),
                          fingerprint=s.fingerprint, num_tokens=num_tokens, num_layers=s.num_layers,
                          num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, first_token=first_token,
                          dtype=s.dtype, layout=s.layout, sizes=list(self.sizes),
                          checksums=list(self.checksums), checksum_algorithm="crc32c",
                          first_tokens=list(first_tokens) if len(first_tokens) > 1 else [])
        self._push(handle_index(s.num_layers), handle.to_json())
        t0 = time.perf_counter()
        try:
            flush(self.transport, self.key)  # pipelined pushes (tcp): wait for their answers
        except errors.TransportError as exc:
            raise _named(self.transport, exc, self.key, "store the pushed blobs") from exc
        self.push_s += time.perf_counter() - t0
        return handle


class Deadline:
    """One time limit for a whole pull: every wait inside it takes the smaller of its slice and what
    is left, and the first wait past it raises."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return self._end - time.monotonic()

    def slice(self, poll_s: float) -> float:
        """The next wait: at most `poll_s`, never past the deadline; 0 once it has passed."""
        return max(0.0, min(poll_s, self.left()))


class KVReceiver:
    """Pulls one request's KV on the decode side, straight into a decode slot; cancellable between
    (and during) blob waits.

    Each blob lands in a staging buffer of the calling thread (allocated once per thread, grown only
    for a longer prompt, so nothing is allocated per request), is checksummed there while it is in
    cache, and is copied into the slot; the handle, pulled last, is then checked against the sizes and
    checksums seen. Checksums are `DEFAULT_CHECKSUM`, what `KVSender` writes; a handle naming another
    algorithm is refused.
    """

    def __init__(self, transport: Any, spec: KVSpec, timeout_s: float = 60.0, poll_s: float = 0.25) -> None:
        self.transport, self.spec = transport, spec
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._staging = threading.local()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._staging.buf = torch.empty(max(nbytes, HANDLE_MAX_BYTES), dtype=torch.uint8)
        return buf

    def receive_into(self, key: str, prompt_len: int, cache: Any, slot: int,
                     cancelled: Callable[[], bool] = lambda: False) -> KVHandle:
        """Every layer's K and V into `cache` slot `slot` at positions [0, prompt_len); returns the
        validated handle (its first token is the request's first)."""
        s = self.spec
        dtype = torch_dtype(s.dtype)
        shape = (s.num_kv_heads, prompt_len, s.head_dim)
        expected = s.num_kv_heads * prompt_len * s.head_dim * dtype.itemsize
        staging = self._buffer(2 * expected)
        deadline = Deadline(self.timeout_s)
        seen: list[tuple[int, int]] = []
        for layer in range(s.num_layers):
            blobs = []
            for index, at in ((k_index(layer), 0), (v_index(layer), expected)):
                blob = staging[at:at + expected]
                got = self._pull(key, index, blob, deadline, cancelled)
                if got != expected:
                    raise errors.TransportIntegrityError(
                        f"KV blob {index} has {got} bytes; a {prompt_len}-token prompt needs {expected} "
                        f"({s.num_kv_heads} kv heads x {s.head_dim} x {s.dtype})", key=key)
                seen.append((got, checksum(as_bytes(blob), DEFAULT_CHECKSUM)))
                debug_log("decode", key, index, blob)
                blobs.append(blob.view(dtype).view(shape))
            cache.load(slot, layer, *blobs)  # the cache's own copy: host tensors, a GPU, or a card
        raw = staging[:HANDLE_MAX_BYTES]
        n = self._pull(key, handle_index(s.num_layers), raw, deadline, cancelled)
        handle = KVHandle.from_json(bytes(raw[:n].numpy()))
        self._check(handle, key, prompt_len, seen)
        return handle

    def _check(self, handle: KVHandle, key: str, prompt_len: int, seen: list[tuple[int, int]]) -> None:
        try:
            handle.validate(self.spec)
            if handle.key != key or handle.num_tokens != prompt_len:
                raise errors.TransportIntegrityError(
                    f"KV handle is for request {handle.key} with {handle.num_tokens} tokens; expected "
                    f"{key} with {prompt_len}", key=key)
            if handle.checksum_algorithm != DEFAULT_CHECKSUM:
                raise errors.TransportIntegrityError(
                    f"KV handle checksums are {handle.checksum_algorithm}; this decode checks "
                    f"{DEFAULT_CHECKSUM} while pulling (prefill and decode run different versions?)", key=key)
            for index, (size, crc) in enumerate(seen):
                handle.verify_sum(index, size, crc)
        except errors.TransportIntegrityError as exc:
            raise _named(self.transport, exc, key, "deliver this request's KV intact") from exc

    def _pull(self, key: str, index: int, out: Any, deadline: Deadline, cancelled: Callable[[], bool]) -> int:
        """Wait for one blob in short slices so a cancel (or prefill's failure) is noticed quickly."""
        while True:
            if cancelled():
                raise errors.RequestCancelled("cancelled while waiting for the KV", key=key)
            wait = deadline.slice(self.poll_s)
            if wait <= 0:
                name = getattr(self.transport, "name", "?")
                raise errors.TransportTimeoutError(
                    f"KV transport {name!r}: blob {index} did not arrive within {deadline.seconds:.0f} s "
                    "(is prefill running and using the same transport?)", key=key)
            try:
                return self.transport.pull(key, index, out, wait)
            except errors.TransportTimeoutError:
                continue
            except errors.TransportError as exc:
                raise _named(self.transport, exc, key, f"pull blob {index}") from exc
