"""`tcp` transport: blobs through a KV relay (`rngd-pd kv-relay`), across pods and nodes.

`RelayClient` is the relay's client API (also the descriptor store of nixl-ucx):
`put(key, index, data)`, `get_into(key, index, out, timeout) -> nbytes`, `get(key, index, timeout) ->
bytes`, `delete(key)`, `stat(key=None)`. Connections are pooled per process and address; each
operation borrows one, so threads work in parallel. Payloads are sent from and received into the
caller's buffers (`sendmsg`/`recv_into`), checked with a CRC per blob by the relay and by the receiver.

Environment: AIRM_KV_TCP_ADDR=host:port (the relay), AIRM_KV_TCP_CRC (1/crc32c default, crc32 for
zlib's CRC-32, 0 to skip), AIRM_KV_TCP_LOG=1 (log size and SHA-256 per blob), AIRM_KV_TCP_SECRET.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from rngd_pd.config.env import AIRM_KV_TCP_ADDR
from rngd_pd.errors import (
    TransportCapacityError,
    TransportError,
    TransportIntegrityError,
    TransportTimeoutError,
)
from rngd_pd.kv.buffers import as_bytes, as_writable_bytes
from rngd_pd.kv.options import RelayOptions, crc_algorithm, options
from rngd_pd.kv.protocol import Closing, ConformanceCase
from rngd_pd.kv.relay import frames
from rngd_pd.kv.relay.pool import Pool, shared_pool, unshare_pool
from rngd_pd.kv.relay.proc import start_relay

log = logging.getLogger("rngd_pd.kv.relay.tcp")
IO_TIMEOUT_S = 60.0  # a relay that stops answering mid-transfer becomes an error, not a hang
AHEAD_WAIT_S = 2.0  # how long the relay holds a read-ahead GET before answering "timeout"
PUSH_WINDOW = 8  # PUTs of one key sent before their answers are waited for (pipelined push)
PUSH_KEYS = 64  # keys with answers still due kept per client; beyond it the oldest is flushed
_ERRORS = {
    frames.ST_TIMEOUT: TransportTimeoutError,
    frames.ST_INTEGRITY: TransportIntegrityError,
    frames.ST_CAPACITY: TransportCapacityError,
}


def parse_addr(addr: str | tuple[str, int] | None) -> tuple[str, int]:
    """host:port (or a tuple) as (host, port)."""
    if not addr:
        raise TransportError("no KV relay address: set AIRM_KV_TCP_ADDR=host:port or pass addr=, "
                             "and start a relay with `rngd-pd kv-relay --port N`")
    if isinstance(addr, tuple):
        return addr[0], int(addr[1])
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"KV relay address {addr!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def _get_frame(index: int, size: int, timeout: float) -> frames.Frame:
    return frames.Frame(frames.OP_GET, index=index, size=size, timeout_ms=max(0, int(timeout * 1000)))


def _log_blob(what: str, key: str, index: int, data: Any) -> None:
    log.info("%s %s[%d] %d bytes sha256=%s", what, key, index, len(data), hashlib.sha256(data).hexdigest())




class RelayClient(Closing):
    """Blocking, thread-safe client of one KV relay."""

    def __init__(self, addr: str | tuple[str, int] | None = None, secret: str | bytes | None = None, *,
                 crc: str | bool | None = True, log_blobs: bool | None = None,
                 max_key_bytes: int = frames.MAX_KEY_BYTES,
                 config: RelayOptions | Mapping[str, str] | str | None = None) -> None:
        o = config if isinstance(config, RelayOptions) else options(RelayOptions, "tcp", config)
        self.addr = parse_addr(addr or o.addr)
        secret = secret if secret is not None else o.secret or None
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.crc = crc_algorithm(o.crc) if crc is True else crc_algorithm(crc)
        self.alg = frames.ALG_IDS[self.crc]
        self.log_blobs = o.log_blobs if log_blobs is None else log_blobs
        self.max_key_bytes = max_key_bytes
        self._pool: Pool | None = shared_pool(self.addr, self.secret, IO_TIMEOUT_S)
        self._ahead: dict[str, tuple[socket.socket, int]] = {}  # key -> connection with a GET in flight
        self._ahead_lock = threading.Lock()
        self._pushing: dict[str, list] = {}  # key -> [connection, PUT answers still due] (pipelined)
        self._push_lock = threading.Lock()

    def _key(self, key: str) -> bytes:
        raw = key.encode()
        if not raw or len(raw) > self.max_key_bytes:
            raise TransportError(f"key must be 1..{self.max_key_bytes} UTF-8 bytes, got {len(raw)}", key=key)
        return raw

    def _acquire(self) -> socket.socket:
        if self._pool is None:
            raise TransportError("RelayClient is closed")
        return self._pool.acquire()

    def _failed(self, sock: socket.socket, key: str, e: BaseException) -> TransportError:
        sock.close()
        kind = TransportTimeoutError if isinstance(e, TimeoutError) else TransportError
        return kind(f"KV relay {self.addr[0]}:{self.addr[1]} failed during a transfer ({e})", key=key)

    def _send(self, sock: socket.socket, key: str, frame: frames.Frame, payload: Any = None) -> None:
        kb = self._key(key)
        frame.klen = len(kb)
        try:
            frames.send_all(sock, [frame.pack(), kb] + ([payload] if payload is not None else []))
        except (OSError, frames.WireError) as e:
            raise self._failed(sock, key, e) from None

    def _receive(self, sock: socket.socket, key: str, out: memoryview | None
                 ) -> tuple[frames.Frame, bytes, memoryview | bytes]:
        """Read one response; an OK payload lands in `out` (or new bytes). The link stays in sync."""
        try:
            hdr = bytearray(frames.HEADER.size)
            frames.recv_exact(sock, memoryview(hdr))
            resp = frames.unpack(hdr)
            msg = bytearray(resp.klen)
            frames.recv_exact(sock, memoryview(msg))
            body: memoryview | bytes = b""
            if resp.op == frames.ST_OK and resp.size:
                if out is not None and resp.size > len(out):  # a read-ahead sized for another buffer
                    frames.recv_exact(sock, memoryview(bytearray(resp.size)))
                    too_large = frames.Frame(frames.ST_TOO_LARGE, size=resp.size)
                    return too_large, b"blob larger than the output", b""
                body = out[: resp.size] if out is not None else memoryview(bytearray(resp.size))
                frames.recv_exact(sock, body)
        except (OSError, frames.WireError) as e:
            raise self._failed(sock, key, e) from None
        return resp, bytes(msg), body

    def _check(self, resp: frames.Frame, msg: bytes, op: int, key: str) -> None:
        if resp.op == frames.ST_OK:
            return
        text = msg.decode("utf-8", "replace") or frames.STATUS_NAMES.get(resp.op, str(resp.op))
        kind = _ERRORS.get(resp.op, TransportError)
        if resp.op == frames.ST_TOO_LARGE:  # our buffer is too small (GET) or the relay's limit (PUT)
            kind = TransportIntegrityError if op == frames.OP_GET else TransportCapacityError
        raise kind(f"KV relay: {text}", key=key)

    def _call(self, key: str, frame: frames.Frame, payload: Any = None, out: memoryview | None = None,
              wait_s: float = 0.0) -> tuple[frames.Frame, memoryview | bytes]:
        """One request/response on a pooled connection; payload lands in `out` (or new bytes)."""
        sock = self._acquire()
        if wait_s:
            frames.set_io_timeout(sock, IO_TIMEOUT_S + wait_s)
        self._send(sock, key, frame, payload)
        resp, msg, body = self._receive(sock, key, out)
        if wait_s:
            frames.set_io_timeout(sock, IO_TIMEOUT_S)
        self._pool.give_back(sock)
        self._check(resp, msg, frame.op, key)
        return resp, body

    def put(self, key: str, index: int, data: Any, wait: bool = True) -> None:
        """Store a blob. `wait`: return once the relay holds it (checksum verified there). Otherwise
        return once the bytes are in the socket (the caller may reuse `data`); the relay's answer is
        read by a later `put` of the key or by `flush(key)`, which raise the first error. Up to
        PUSH_WINDOW answers are due at once, so sending blob i+1 overlaps the relay checking blob i.
        """
        view = as_bytes(data)
        crc = frames.blob_crc(self.alg, view)
        if self.log_blobs:
            _log_blob("push", key, index, view)
        frame = frames.Frame(frames.OP_PUT, self.alg, index=index, size=len(view), crc=crc)
        if wait:
            self._call(key, frame, view)
            return
        with self._push_lock:
            state = self._pushing.pop(key, None)  # ours while we send: one sender per connection
        if state is None:
            state = [self._acquire(), 0]
        self._send(state[0], key, frame, view)  # closes the connection and raises on failure
        state[1] += 1
        try:
            self._collect(state, key, keep=PUSH_WINDOW)
        except BaseException:
            state[0].close()  # answers may still be due on it: never reuse
            raise
        with self._push_lock:
            same = self._pushing.pop(key, None)  # another thread pushed this key meanwhile
            self._pushing[key] = state
            stale = []  # a caller that never flushes must not pile up connections
            while len(self._pushing) > PUSH_KEYS:
                oldest = next(iter(self._pushing))
                stale.append((oldest, self._pushing.pop(oldest)))
        for other, old in stale:
            try:
                self._drain(old, other)
            except TransportError as e:  # nobody flushed that key: its puller will time out
                log.warning("unflushed pushes of %s failed: %s", other, e)
        if same is not None:
            self._drain(same, key)

    def _collect(self, state: list, key: str, keep: int) -> None:
        """Read PUT answers until at most `keep` are due (and, beyond that, those already here)."""
        sock = state[0]
        while state[1] and (state[1] > keep or select.select([sock], [], [], 0)[0]):
            resp, msg, _ = self._receive(sock, key, None)  # closes the connection on I/O errors
            state[1] -= 1
            self._check(resp, msg, frames.OP_PUT, key)

    def _drain(self, state: list, key: str) -> None:
        try:
            self._collect(state, key, keep=0)
        except BaseException:
            state[0].close()
            raise
        if self._pool is not None:
            self._pool.give_back(state[0])
        else:  # closed meanwhile
            state[0].close()

    def flush(self, key: str) -> None:
        """Wait for every answer due for `key`'s pipelined PUTs; raise the first error (no-op if none)."""
        with self._push_lock:
            state = self._pushing.pop(key, None)
        if state is not None:
            self._drain(state, key)

    def get_into(self, key: str, index: int, out: Any, timeout: float, read_ahead: bool = False) -> int:
        """Wait up to `timeout` s for the blob, receive it into `out`, verify its checksum; return nbytes.

        With `read_ahead`, the GET for blob index+1 is sent before returning, on the same connection,
        so a caller pulling in order finds the next blob already on its way (received into the next
        call's buffer: still one copy). A pull of another index just drops that connection.
        """
        view = as_writable_bytes(out)
        deadline = time.monotonic() + timeout
        got = self._claim_ahead(key, index, view, timeout) if read_ahead else None
        if got is None:
            timeout = max(0.0, deadline - time.monotonic())  # what a consumed read-ahead left
            sock = self._acquire()
            frames.set_io_timeout(sock, IO_TIMEOUT_S + timeout)
            self._send(sock, key, _get_frame(index, len(view), timeout), None)
            got = (sock, *self._receive(sock, key, view))
        sock, resp, msg, body = got
        frames.set_io_timeout(sock, IO_TIMEOUT_S)
        if read_ahead and resp.op == frames.ST_OK:
            self._send(sock, key, _get_frame(index + 1, len(view), AHEAD_WAIT_S), None)
            self._park_ahead(key, sock, index + 1)
        else:
            self._pool.give_back(sock)
        self._check(resp, msg, frames.OP_GET, key)
        if self.alg and resp.alg and frames.blob_crc(resp.alg, body) != resp.crc:
            raise TransportIntegrityError(f"checksum mismatch on blob {index} as received from the relay",
                                          key=key)
        if self.log_blobs:
            _log_blob("pull", key, index, body)
        return resp.size

    def _claim_ahead(self, key: str, index: int, view: memoryview, timeout: float) -> tuple | None:
        """The response of an earlier read-ahead GET for (key, index), or None to ask afresh."""
        with self._ahead_lock:
            parked = self._ahead.pop(key, None)
        if parked is None:
            return None
        sock, ahead_index = parked
        if ahead_index != index:
            sock.close()  # its response is still due: the connection cannot be reused
            return None
        if not select.select([sock], [], [], max(0.0, timeout))[0]:
            self._park_ahead(key, sock, index)  # still in sync, still waiting: keep it for the retry
            raise TransportTimeoutError(f"blob {index} did not arrive within {timeout:g} s", key=key)
        resp, msg, body = self._receive(sock, key, view)
        if resp.op in (frames.ST_TIMEOUT, frames.ST_TOO_LARGE):  # its own short wait ran out, or sized
            self._pool.give_back(sock)  # for another buffer: ask again with this call's terms
            return None
        return sock, resp, msg, body

    def _park_ahead(self, key: str, sock: socket.socket, index: int) -> None:
        with self._ahead_lock:
            old = self._ahead.pop(key, None)
            self._ahead[key] = (sock, index)
        if old is not None:
            old[0].close()

    def drop_read_ahead(self, key: str) -> None:
        """Forget a pending read-ahead of `key` (its connection is closed)."""
        with self._ahead_lock:
            parked = self._ahead.pop(key, None)
        if parked is not None:
            parked[0].close()

    def get(self, key: str, index: int, timeout: float, max_bytes: int = 1 << 20,
            read_ahead: bool = False) -> bytes:
        """Small blobs (descriptors, handles) as bytes; `read_ahead` as in get_into."""
        buf = bytearray(max_bytes)
        n = self.get_into(key, index, buf, timeout, read_ahead)
        return bytes(buf[:n])

    def delete(self, key: str) -> int:
        """Drop every blob of `key`; returns how many there were."""
        resp, _ = self._call(key, frames.Frame(frames.OP_DEL))
        return resp.crc

    def stat(self, key: str | None = None) -> dict:
        """The relay's counters: keys, blobs, used_bytes, pool_bytes, max_bytes (+ key_blobs)."""
        frame = frames.Frame(frames.OP_STAT, flags=1 if key is not None else 0)
        _, body = self._call(key or "-", frame)
        return json.loads(bytes(body))

    def close(self) -> None:
        with self._ahead_lock:
            parked, self._ahead = list(self._ahead.values()), {}
        with self._push_lock:
            pushing, self._pushing = list(self._pushing.values()), {}
        for sock, _ in parked + pushing:
            sock.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            unshare_pool(pool)


class TcpTransport(Closing):
    """The `tcp` transport: the Transport protocol over a RelayClient."""

    name = "tcp"

    def __init__(self, addr: str | tuple[str, int] | None = None, secret: str | bytes | None = None,
                 crc: str | bool | None = True, log_blobs: bool | None = None,
                 read_ahead: bool = True, *, config: Mapping[str, str] | str | None = None) -> None:
        self.client = RelayClient(addr, secret, crc=crc, log_blobs=log_blobs,
                                  config=options(RelayOptions, self.name, config))
        self.read_ahead = read_ahead  # pulls in index order find the next blob already requested

    def push(self, key: str, index: int, data: Any) -> None:
        self.client.put(key, index, data, wait=False)  # pipelined: errors come by a later push or flush

    def flush(self, key: str) -> None:
        """Every blob pushed for `key` is stored at the relay once this returns (else it raises)."""
        self.client.flush(key)

    def pull(self, key: str, index: int, out: Any, timeout: float) -> int:
        return self.client.get_into(key, index, out, timeout, read_ahead=self.read_ahead)

    def release(self, key: str) -> None:
        with contextlib.suppress(TransportError):  # our own PUTs must not land after the DELETE
            self.client.flush(key)
        self.client.drop_read_ahead(key)
        self.client.delete(key)

    def close(self) -> None:
        self.client.close()

    @classmethod
    @contextlib.contextmanager
    def conformance_case(cls) -> Iterator[ConformanceCase]:
        """The relay at $AIRM_KV_TCP_ADDR, or one started on a free loopback port (plus one with a
        short TTL for the expiry case) and stopped afterwards."""
        with contextlib.ExitStack() as stack:
            addr = AIRM_KV_TCP_ADDR.get()
            ttl_opts = None
            if not addr:
                addr = stack.enter_context(start_relay()).addr
                ttl_addr = stack.enter_context(start_relay("127.0.0.1", 0, "--ttl-s", "0.5")).addr
                ttl_opts = {"addr": ttl_addr}
            probe = stack.enter_context(RelayClient(addr))
            ttl_probe = stack.enter_context(RelayClient(ttl_opts["addr"])) if ttl_opts else None

            def stored_blobs(key: str) -> int:
                counts = [c.stat(key)["key_blobs"] for c in (probe, ttl_probe) if c is not None]
                return sum(counts)

            yield ConformanceCase(
                options={"addr": addr}, env={AIRM_KV_TCP_ADDR.name: addr}, ttl_s=0.5, ttl_options=ttl_opts,
                corrupt=_corrupt_in_transit, stored_blobs=stored_blobs,
                stored_bytes=lambda: probe.stat()["used_bytes"])


def _corrupt_in_transit(t: TcpTransport, key: str, index: int, data: bytes) -> None:
    """Send `data` with one byte flipped after its checksum was taken (the relay must refuse it)."""
    c = t.client
    frame = frames.Frame(frames.OP_PUT, c.alg or frames.ALG_IDS["crc32c"], index=index, size=len(data),
                       crc=frames.blob_crc(c.alg or frames.ALG_IDS["crc32c"], memoryview(data)))
    bad = bytearray(data)
    bad[0] ^= 0xFF
    c._call(key, frame, memoryview(bad))
