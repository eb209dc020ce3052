"""Per-process pools of authenticated connections to a KV relay (used by RelayClient).

One pool per (address, secret) and process: every RelayClient of the process borrows from it, so
threads run transfers in parallel and nothing reconnects per blob. A forked child starts empty.
"""

from __future__ import annotations

import os
import socket
import threading

from rngd_pd.errors import TransportError
from rngd_pd.kv.relay import frames


class Pool:
    """Idle authenticated connections to one relay."""

    def __init__(self, addr: tuple[str, int], secret: bytes | None, io_timeout: float) -> None:
        self.addr, self.secret, self.io_timeout = addr, secret, io_timeout
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
            sock = socket.create_connection(self.addr, timeout=self.io_timeout)
        except OSError as e:
            raise TransportError(f"cannot reach the KV relay at {self.addr[0]}:{self.addr[1]} ({e}); "
                                 "is `rngd-pd kv-relay` running there?") from None
        frames.tune_socket(sock)
        frames.set_io_timeout(sock, self.io_timeout)
        try:
            self._handshake(sock)
        except (OSError, frames.WireError) as e:
            sock.close()
            where = f"{self.addr[0]}:{self.addr[1]}"
            raise TransportError(f"KV relay handshake with {where} failed ({e})") from None
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        hdr = bytearray(frames.HEADER.size)
        frames.recv_exact(sock, memoryview(hdr))
        f = frames.unpack(hdr)
        nonce = bytearray(f.size)
        frames.recv_exact(sock, memoryview(nonce))
        if not f.flags & frames.FLAG_AUTH_REQUIRED:
            return
        if not self.secret:
            raise TransportError("the KV relay requires a shared secret: "
                                 "set AIRM_KV_TCP_SECRET or pass secret=")
        digest = frames.auth_digest(self.secret, bytes(nonce))
        frames.send_all(sock, [frames.Frame(frames.OP_AUTH, size=len(digest)).pack(), digest])
        frames.recv_exact(sock, memoryview(hdr))
        if frames.unpack(hdr).op != frames.ST_OK:
            raise TransportError("the KV relay refused our secret "
                                 "(AIRM_KV_TCP_SECRET differs from the relay's)")


_pools: dict[tuple[tuple[str, int], bytes | None], Pool] = {}
_pools_lock = threading.Lock()
_pools_pid = os.getpid()


def shared_pool(addr: tuple[str, int], secret: bytes | None, io_timeout: float) -> Pool:
    """This process's pool for (addr, secret), with one more reference."""
    global _pools_pid
    with _pools_lock:
        if os.getpid() != _pools_pid:  # forked: the parent's sockets are not ours
            _pools.clear()
            _pools_pid = os.getpid()
        pool = _pools.setdefault((addr, secret), Pool(addr, secret, io_timeout))
        pool.refs += 1
        return pool


def unshare_pool(pool: Pool) -> None:
    """Drop a reference; the last one closes the pool's connections."""
    with _pools_lock:
        pool.refs -= 1
        if pool.refs <= 0:
            if _pools.get((pool.addr, pool.secret)) is pool:
                del _pools[(pool.addr, pool.secret)]
            pool.close()
