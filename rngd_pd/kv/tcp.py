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
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

from rngd_pd.errors import (
    TransportCapacityError,
    TransportError,
    TransportIntegrityError,
    TransportTimeoutError,
)
from rngd_pd.kv import wire
from rngd_pd.kv.buffers import as_bytes, as_writable_bytes
from rngd_pd.kv.protocol import ConformanceCase

log = logging.getLogger("rngd_pd.kv.tcp")
IO_TIMEOUT_S = 60.0  # a relay that stops answering mid-transfer becomes an error, not a hang
_ERRORS = {
    wire.ST_TIMEOUT: TransportTimeoutError,
    wire.ST_INTEGRITY: TransportIntegrityError,
    wire.ST_CAPACITY: TransportCapacityError,
}


def parse_addr(addr: str | tuple[str, int] | None) -> tuple[str, int]:
    """host:port (or a tuple; None -> $AIRM_KV_TCP_ADDR) as (host, port)."""
    addr = addr or os.environ.get("AIRM_KV_TCP_ADDR")
    if not addr:
        raise TransportError("no KV relay address: set AIRM_KV_TCP_ADDR=host:port or pass addr=, "
                             "and start a relay with `rngd-pd kv-relay --port N`")
    if isinstance(addr, tuple):
        return addr[0], int(addr[1])
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"KV relay address {addr!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def crc_from_env(value: str | None = None) -> str | None:
    """AIRM_KV_TCP_CRC: "0" -> None (skip), "crc32" -> zlib CRC-32, anything else -> crc32c."""
    value = (value if value is not None else os.environ.get("AIRM_KV_TCP_CRC", "1")).strip().lower()
    if value in ("0", "off", "false", "no", "none"):
        return None
    return "crc32" if value == "crc32" else "crc32c"


def _log_blob(what: str, key: str, index: int, data: Any) -> None:
    log.info("%s %s[%d] %d bytes sha256=%s", what, key, index, len(data), hashlib.sha256(data).hexdigest())




class _Pool:
    """Idle authenticated connections to one relay, shared by every client of the process."""

    def __init__(self, addr: tuple[str, int], secret: bytes | None) -> None:
        self.addr, self.secret = addr, secret
        self.idle: list[socket.socket] = []
        self.lock = threading.Lock()
        self.refs = 0

    def acquire(self) -> socket.socket:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return self._connect()

    def give_back(self, sock: socket.socket) -> None:
        with self.lock:
            self.idle.append(sock)

    def close(self) -> None:
        with self.lock:
            for s in self.idle:
                s.close()
            self.idle.clear()

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.addr, timeout=IO_TIMEOUT_S)
        except OSError as e:
            raise TransportError(f"cannot reach the KV relay at {self.addr[0]}:{self.addr[1]} ({e}); "
                                 "is `rngd-pd kv-relay` running there?") from None
        wire.tune_socket(sock)
        wire.set_io_timeout(sock, IO_TIMEOUT_S)
        try:
            self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        hdr = bytearray(wire.HEADER.size)
        wire.recv_exact(sock, memoryview(hdr))
        f = wire.unpack(hdr)
        nonce = bytearray(f.size)
        wire.recv_exact(sock, memoryview(nonce))
        if not f.flags & wire.FLAG_AUTH_REQUIRED:
            return
        if not self.secret:
            raise TransportError("the KV relay requires a shared secret: "
                                 "set AIRM_KV_TCP_SECRET or pass secret=")
        digest = wire.auth_digest(self.secret, bytes(nonce))
        wire.send_all(sock, [wire.Frame(wire.OP_AUTH, size=len(digest)).pack(), digest])
        wire.recv_exact(sock, memoryview(hdr))
        if wire.unpack(hdr).op != wire.ST_OK:
            raise TransportError("the KV relay refused our secret "
                                 "(AIRM_KV_TCP_SECRET differs from the relay's)")


_pools: dict[tuple[tuple[str, int], bytes | None], _Pool] = {}
_pools_lock = threading.Lock()
_pools_pid = os.getpid()


def _shared_pool(addr: tuple[str, int], secret: bytes | None) -> _Pool:
    global _pools_pid
    with _pools_lock:
        if os.getpid() != _pools_pid:  # forked: the parent's sockets are not ours
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.setdefault((addr, secret), _Pool(addr, secret))
        pool.refs += 1
        return pool


class RelayClient:
    """Blocking, thread-safe client of one KV relay."""

    def __init__(self, addr: str | tuple[str, int] | None = None, secret: str | bytes | None = None, *,
                 crc: str | bool | None = True, log_blobs: bool | None = None,
                 max_key_bytes: int = 512) -> None:
        self.addr = parse_addr(addr)
        secret = secret if secret is not None else os.environ.get("AIRM_KV_TCP_SECRET") or None
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.crc = crc_from_env() if crc is True else (crc or None)
        self.alg = wire.ALG_IDS[self.crc]
        self.log_blobs = os.environ.get("AIRM_KV_TCP_LOG", "0") == "1" if log_blobs is None else log_blobs
        self.max_key_bytes = max_key_bytes
        self._pool: _Pool | None = _shared_pool(self.addr, self.secret)

    def _key(self, key: str) -> bytes:
        raw = key.encode()
        if not raw or len(raw) > self.max_key_bytes:
            raise TransportError(f"key must be 1..{self.max_key_bytes} UTF-8 bytes, got {len(raw)}", key=key)
        return raw

    def _call(self, key: str, frame: wire.Frame, payload: Any = None, out: memoryview | None = None,
              wait_s: float = 0.0) -> tuple[wire.Frame, memoryview | bytes]:
        """One request/response on a pooled connection; payload lands in `out` (or new bytes)."""
        if self._pool is None:
            raise TransportError("RelayClient is closed")
        kb = self._key(key)
        frame.klen = len(kb)
        sock = self._pool.acquire()
        try:
            if wait_s:
                wire.set_io_timeout(sock, IO_TIMEOUT_S + wait_s)
            wire.send_all(sock, [frame.pack(), kb] + ([payload] if payload is not None else []))
            hdr = bytearray(wire.HEADER.size)
            wire.recv_exact(sock, memoryview(hdr))
            resp = wire.unpack(hdr)
            msg = bytearray(resp.klen)
            wire.recv_exact(sock, memoryview(msg))
            body: memoryview | bytes = b""
            if resp.op == wire.ST_OK and resp.size:
                body = out[: resp.size] if out is not None else memoryview(bytearray(resp.size))
                wire.recv_exact(sock, body)
        except (OSError, wire.WireError) as e:
            sock.close()
            kind = TransportTimeoutError if isinstance(e, TimeoutError) else TransportError
            raise kind(f"KV relay {self.addr[0]}:{self.addr[1]} failed during a transfer ({e})",
                       key=key) from None
        if wait_s:
            wire.set_io_timeout(sock, IO_TIMEOUT_S)
        self._pool.give_back(sock)
        if resp.op != wire.ST_OK:
            text = msg.decode("utf-8", "replace") or wire.STATUS_NAMES.get(resp.op, str(resp.op))
            kind = _ERRORS.get(resp.op, TransportError)
            if resp.op == wire.ST_TOO_LARGE:  # our buffer is too small (GET) or the relay's limit (PUT)
                kind = TransportIntegrityError if frame.op == wire.OP_GET else TransportCapacityError
            raise kind(f"KV relay: {text}", key=key)
        return resp, body

    def put(self, key: str, index: int, data: Any) -> None:
        """Store a blob; returns once the relay holds it (checksum verified there)."""
        view = as_bytes(data)
        crc = wire.blob_crc(self.alg, view)
        if self.log_blobs:
            _log_blob("push", key, index, view)
        self._call(key, wire.Frame(wire.OP_PUT, self.alg, index=index, size=len(view), crc=crc), view)

    def get_into(self, key: str, index: int, out: Any, timeout: float) -> int:
        """Wait up to `timeout` s for the blob, receive it into `out`, verify its checksum; return nbytes."""
        view = as_writable_bytes(out)
        frame = wire.Frame(wire.OP_GET, index=index, size=len(view), timeout_ms=max(0, int(timeout * 1000)))
        resp, body = self._call(key, frame, out=view, wait_s=timeout)
        if self.alg and resp.alg and wire.blob_crc(resp.alg, body) != resp.crc:
            raise TransportIntegrityError(f"checksum mismatch on blob {index} as received from the relay",
                                          key=key)
        if self.log_blobs:
            _log_blob("pull", key, index, body)
        return resp.size

    def get(self, key: str, index: int, timeout: float, max_bytes: int = 1 << 20) -> bytes:
        """Small blobs (descriptors, handles) as bytes."""
        buf = bytearray(max_bytes)
        n = self.get_into(key, index, buf, timeout)
        return bytes(buf[:n])

    def delete(self, key: str) -> int:
        """Drop every blob of `key`; returns how many there were."""
        resp, _ = self._call(key, wire.Frame(wire.OP_DEL))
        return resp.crc

    def stat(self, key: str | None = None) -> dict:
        """The relay's counters: keys, blobs, used_bytes, pool_bytes, max_bytes (+ key_blobs)."""
        frame = wire.Frame(wire.OP_STAT, flags=1 if key is not None else 0)
        _, body = self._call(key or "-", frame)
        return json.loads(bytes(body))

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with _pools_lock:
                pool.refs -= 1
                if pool.refs <= 0:
                    _pools.pop((pool.addr, pool.secret), None)
                    pool.close()

    def __enter__(self) -> RelayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TcpTransport:
    """The `tcp` transport: the Transport protocol over a RelayClient."""

    name = "tcp"

    def __init__(self, addr: str | tuple[str, int] | None = None, secret: str | bytes | None = None,
                 crc: str | bool | None = True, log_blobs: bool | None = None) -> None:
        self.client = RelayClient(addr, secret, crc=crc, log_blobs=log_blobs)

    def push(self, key: str, index: int, data: Any) -> None:
        self.client.put(key, index, data)

    def pull(self, key: str, index: int, out: Any, timeout: float) -> int:
        return self.client.get_into(key, index, out, timeout)

    def release(self, key: str) -> None:
        self.client.delete(key)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    @contextlib.contextmanager
    def conformance_case(cls) -> Iterator[ConformanceCase]:
        """The relay at $AIRM_KV_TCP_ADDR, or one started on a free loopback port (plus one with a
        short TTL for the expiry case) and stopped afterwards."""
        from rngd_pd.kv.relayproc import start_relay

        with contextlib.ExitStack() as stack:
            addr = os.environ.get("AIRM_KV_TCP_ADDR")
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
                options={"addr": addr}, env={"AIRM_KV_TCP_ADDR": addr}, ttl_s=0.5, ttl_options=ttl_opts,
                corrupt=_corrupt_in_transit, stored_blobs=stored_blobs,
                stored_bytes=lambda: probe.stat()["used_bytes"])


def _corrupt_in_transit(t: TcpTransport, key: str, index: int, data: bytes) -> None:
    """Send `data` with one byte flipped after its checksum was taken (the relay must refuse it)."""
    c = t.client
    frame = wire.Frame(wire.OP_PUT, c.alg or wire.ALG_IDS["crc32c"], index=index, size=len(data),
                       crc=wire.blob_crc(c.alg or wire.ALG_IDS["crc32c"], memoryview(data)))
    bad = bytearray(data)
    bad[0] ^= 0xFF
    c._call(key, frame, memoryview(bad))
