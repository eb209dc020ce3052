"""The KV relay: a standard-library server that stores blobs by (key, index).

Prefill processes PUT blobs, decode processes GET them; a GET for a blob not there yet is held until
the blob arrives or its timeout passes. Each connection has its own thread doing blocking calls: a
payload is received straight into a preallocated buffer by one MSG_WAITALL `recv_into` and sent from
it by one `sendmsg` (no per-byte Python work, no StreamReader copies). Freed buffers are kept in a
small pool so the next request's pages are already faulted. Threads rather than asyncio by
measurement: an asyncio loop costs a wake-up per TCP segment (`sock_recv_into`) or a thread hand-off
per blob (executor) (docs/kv.md, "Why threads, not asyncio", has the figures).
Memory is capped (`max_bytes`: a PUT beyond it gets a capacity error), blobs nobody touches for
`ttl_s` are dropped, and with a `secret` every connection must answer an HMAC challenge first.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from rngd_pd.config.env import AIRM_KV_TCP_LOG, AIRM_KV_TCP_SECRET, AIRM_KV_TCP_TTL_S
from rngd_pd.kv.buffers import make_room
from rngd_pd.kv.relay import frames

log = logging.getLogger("rngd_pd.kv.relay.server")
IO_TIMEOUT_S = 60.0  # a client that stalls mid-payload is dropped after this


@dataclass
class RelayConfig:
    """Limits and policy of one relay."""

    max_bytes: int = 4 << 30
    ttl_s: float = AIRM_KV_TCP_TTL_S.default
    max_blob_bytes: int = 1 << 30
    max_key_bytes: int = frames.MAX_KEY_BYTES
    pool_bytes: int = 512 << 20  # idle buffers kept for reuse (already faulted in)
    secret: bytes | None = None
    log_blobs: bool = False


@dataclass
class Blob:
    buf: bytearray
    size: int
    crc: int
    alg: int
    readers: int = 0
    dead: bool = False


@dataclass
class Entry:
    blobs: dict[int, Blob] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)


class Store:
    """Blobs by key, the memory account, the buffer pool and the waiting GETs; thread-safe."""

    def __init__(self, cfg: RelayConfig) -> None:
        self.cfg = cfg
        self.entries: dict[str, Entry] = {}
        self.used = 0  # bytes of stored and in-flight blobs
        self.pool: dict[int, list[bytearray]] = defaultdict(list)
        self.pooled = 0
        self.waiters: dict[tuple[str, int], list] = {}  # (key, index) -> [Event, number waiting]
        self.lock = threading.Lock()

    def reserve(self, size: int) -> bytearray | None:
        """Account `size` bytes and hand out a buffer, or None when over the cap."""
        with self.lock:
            if self.used + size > self.cfg.max_bytes:
                return None
            self.used += size
            free = self.pool.get(size)
            if free:
                self.pooled -= size
                return free.pop()
        return bytearray(size)

    def unreserve(self, buf: bytearray) -> None:
        with self.lock:
            self._unreserve(buf)

    def _unreserve(self, buf: bytearray) -> None:
        """Keep a freed buffer for the next blob of its size (see buffers.make_room: a pool that kept
        only 1 MiB buffers made every 4 MiB blob fault fresh pages in, ~2x slower at S=2048)."""
        size = len(buf)
        self.used -= size
        self.pooled, fits = make_room(self.pool, size, self.pooled, self.cfg.pool_bytes)
        if fits:
            self.pool[size].append(buf)
            self.pooled += size

    def _drop(self, blob: Blob) -> None:
        blob.dead = True
        if blob.readers == 0:
            self._unreserve(blob.buf)

    def put(self, key: str, index: int, blob: Blob) -> None:
        with self.lock:
            entry = self.entries.setdefault(key, Entry())
            entry.touched = time.monotonic()
            old = entry.blobs.pop(index, None)
            if old is not None:
                self._drop(old)
            entry.blobs[index] = blob
            waiting = self.waiters.get((key, index))
        if waiting:
            waiting[0].set()

    def acquire(self, key: str, index: int, timeout: float) -> Blob | None:
        """The blob, waited for up to `timeout` s and pinned (readers + 1) until `unpin`."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                entry = self.entries.get(key)
                blob = entry.blobs.get(index) if entry else None
                if blob is not None:
                    entry.touched = time.monotonic()
                    blob.readers += 1
                    return blob
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                waiting = self.waiters.setdefault((key, index), [threading.Event(), 0])
                waiting[1] += 1
            waiting[0].wait(remaining)
            with self.lock:
                waiting[1] -= 1
                if waiting[1] == 0 and self.waiters.get((key, index)) is waiting:
                    del self.waiters[(key, index)]

    def unpin(self, blob: Blob) -> None:
        with self.lock:
            blob.readers -= 1
            if blob.dead and blob.readers == 0:
                self._unreserve(blob.buf)

    def delete(self, key: str) -> int:
        with self.lock:
            entry = self.entries.pop(key, None)
            for blob in entry.blobs.values() if entry else ():
                self._drop(blob)
            return len(entry.blobs) if entry else 0

    def expire(self) -> int:
        limit = time.monotonic() - self.cfg.ttl_s
        with self.lock:
            old = [k for k, e in self.entries.items() if e.touched < limit]
        for key in old:
            log.info("expired unclaimed key %s", key)
            self.delete(key)
        return len(old)

    def stat(self, key: str | None) -> dict:
        with self.lock:
            blobs = sum(len(e.blobs) for e in self.entries.values())
            out = {"keys": len(self.entries), "blobs": blobs, "used_bytes": self.used,
                   "pool_bytes": self.pooled, "max_bytes": self.cfg.max_bytes}
            if key is not None:
                entry = self.entries.get(key)
                out["key_blobs"] = len(entry.blobs) if entry else 0
        return out


class Connection:
    """One client connection, served by its own thread with blocking calls on a blocking socket."""

    def __init__(self, server: RelayServer, sock: socket.socket) -> None:
        self.store = server.store
        self.cfg = server.cfg
        self.sock = sock
        self.hdr = memoryview(bytearray(frames.HEADER.size))

    def recv_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        frames.recv_exact(self.sock, memoryview(buf))
        return bytes(buf)

    def reply(self, status: int, msg: str = "", *, size: int = 0, crc: int = 0, alg: int = 0,
              flags: int = 0, payload: memoryview | bytes | None = None) -> None:
        text = msg.encode()[:60000]
        head = frames.Frame(status, alg, flags, len(text), 0, size, crc).pack()
        frames.send_all(self.sock, [head, text] + ([payload] if payload is not None else []))

    def handshake(self) -> None:
        nonce = secrets.token_bytes(frames.NONCE_BYTES)
        flags = frames.FLAG_AUTH_REQUIRED if self.cfg.secret else 0
        self.reply(frames.ST_OK, size=len(nonce), flags=flags, payload=nonce)
        if not self.cfg.secret:
            return
        frames.recv_exact(self.sock, self.hdr)
        f = frames.unpack(self.hdr)
        answer = self.recv_bytes(min(f.size, 64)) if f.op == frames.OP_AUTH else b""
        if not hmac.compare_digest(answer, frames.auth_digest(self.cfg.secret, nonce)):
            self.reply(frames.ST_AUTH, "relay secret does not match (AIRM_KV_TCP_SECRET)")
            raise ConnectionError("client failed the HMAC challenge")
        self.reply(frames.ST_OK)

    def serve(self) -> None:
        self.handshake()
        handlers = {frames.OP_PUT: self.put, frames.OP_GET: self.get, frames.OP_DEL: self.delete,
                    frames.OP_STAT: self.stat}
        while True:
            try:
                frames.recv_exact(self.sock, self.hdr)
            except TimeoutError:
                continue  # an idle pooled connection: keep it
            f = frames.unpack(self.hdr)
            if f.klen > self.cfg.max_key_bytes:
                self.reply(frames.ST_BAD, f"key of {f.klen} bytes exceeds the relay's limit of "
                                        f"{self.cfg.max_key_bytes}")
                raise ConnectionError("key too long")  # cannot resynchronise cheaply: drop the link
            key = self.recv_bytes(f.klen).decode("utf-8", "replace")
            handler = handlers.get(f.op)
            if handler is None:
                self.reply(frames.ST_BAD, f"unknown op {f.op}")
                raise ConnectionError("unknown op")
            handler(f, key)

    def discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, len(scratch))
            frames.recv_exact(self.sock, scratch[:k])
            n -= k

    def put(self, f: frames.Frame, key: str) -> None:
        if f.size > self.cfg.max_blob_bytes:
            self.discard(f.size)
            return self.reply(frames.ST_TOO_LARGE, f"blob of {f.size} bytes exceeds the relay's limit of "
                                                 f"{self.cfg.max_blob_bytes} (--max-blob-mb)")
        buf = self.store.reserve(f.size)
        if buf is None:
            self.discard(f.size)
            return self.reply(frames.ST_CAPACITY, f"relay memory cap reached ({self.store.used} of "
                                                f"{self.cfg.max_bytes} bytes in use); release keys "
                                                "or raise --max-mb")
        try:
            frames.recv_exact(self.sock, memoryview(buf))  # one MSG_WAITALL recv, straight into place
        except BaseException:
            self.store.unreserve(buf)
            raise
        if f.alg and frames.blob_crc(f.alg, memoryview(buf)) != f.crc:
            self.store.unreserve(buf)
            return self.reply(frames.ST_INTEGRITY, f"checksum mismatch on blob {f.index} of {key} "
                                                 "as received by the relay")
        if self.cfg.log_blobs:
            log.info("put %s[%d] %d bytes sha256=%s", key, f.index, f.size, hashlib.sha256(buf).hexdigest())
        self.store.put(key, f.index, Blob(buf, f.size, f.crc, f.alg))
        self.reply(frames.ST_OK)

    def get(self, f: frames.Frame, key: str) -> None:
        blob = self.store.acquire(key, f.index, f.timeout_ms / 1000.0)
        if blob is None:
            return self.reply(frames.ST_TIMEOUT, f"blob {f.index} of {key} did not arrive within "
                                               f"{f.timeout_ms} ms")
        try:
            if blob.size > f.size:
                return self.reply(frames.ST_TOO_LARGE, f"blob {f.index} of {key} has {blob.size} bytes, "
                                                     f"the output buffer only {f.size}", size=blob.size)
            self.reply(frames.ST_OK, size=blob.size, crc=blob.crc, alg=blob.alg,
                       payload=memoryview(blob.buf)[: blob.size])
        finally:
            self.store.unpin(blob)

    def delete(self, f: frames.Frame, key: str) -> None:
        self.reply(frames.ST_OK, size=0, crc=self.store.delete(key))

    def stat(self, f: frames.Frame, key: str) -> None:
        body = json.dumps(self.store.stat(key if f.flags else None)).encode()
        self.reply(frames.ST_OK, size=len(body), payload=body)


class RelayServer:
    """Listens on (host, port); `serve_forever` accepts until `shutdown`, a thread per connection."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, cfg: RelayConfig | None = None) -> None:
        self.cfg = cfg or RelayConfig()
        self.store = Store(self.cfg)
        self.sock = socket.create_server((host, port), backlog=256)
        self.address = self.sock.getsockname()[:2]
        self._stop = threading.Event()

    def serve_forever(self) -> None:
        threading.Thread(target=self._sweep, name="kv-relay-ttl", daemon=True).start()
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            frames.tune_socket(conn)
            frames.set_io_timeout(conn, IO_TIMEOUT_S)
            threading.Thread(target=self._run, args=(conn,), name="kv-relay-conn", daemon=True).start()
        self.sock.close()

    def shutdown(self) -> None:
        self._stop.set()

    def _run(self, conn: socket.socket) -> None:
        try:
            Connection(self, conn).serve()
        except (ConnectionError, frames.WireError, OSError) as e:
            log.debug("connection closed: %s", e)
        finally:
            conn.close()

    def _sweep(self) -> None:
        while not self._stop.wait(max(0.05, min(1.0, self.cfg.ttl_s / 4))):
            self.store.expire()


def config_from_env(env: Mapping[str, str] | None = None, **overrides: object) -> RelayConfig:
    """RelayConfig with AIRM_KV_TCP_TTL_S / AIRM_KV_TCP_LOG / AIRM_KV_TCP_SECRET applied (read as the
    clients read them: the registry's types and its one boolean rule), then overrides."""
    secret = AIRM_KV_TCP_SECRET.get(env)
    cfg = RelayConfig(
        ttl_s=AIRM_KV_TCP_TTL_S.get(env),
        log_blobs=AIRM_KV_TCP_LOG.get(env),
        secret=secret.encode() if secret else None,
    )
    for name, value in overrides.items():
        if value is not None:
            setattr(cfg, name, value)
    return cfg
