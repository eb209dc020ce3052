"""The KV relay: an asyncio server (standard library only) that stores blobs by (key, index).

Prefill processes PUT blobs, decode processes GET them; a GET for a blob not there yet is held until
the blob arrives or its timeout passes. The event loop does the framing, waiting and expiry; payloads
are received straight into preallocated buffers and sent from them by one blocking MSG_WAITALL
`recv_into` / `sendmsg` on a worker thread (no per-byte Python work, no StreamReader copies, no loop
wake-up per TCP segment); freed buffers are kept in a small pool so the next request's pages are
already faulted.
Memory is capped (`max_bytes`: a PUT beyond it gets a capacity error), blobs nobody touches for
`ttl_s` are dropped, and with a `secret` every connection must answer an HMAC challenge first.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rngd_pd.kv import wire

log = logging.getLogger("rngd_pd.kv.relay")
BULK_BYTES = 64 << 10  # payloads from this size move on a worker thread with blocking calls
IO_TIMEOUT_S = 60.0  # a client that stalls mid-payload is dropped after this


@dataclass
class RelayConfig:
    """Limits and policy of one relay."""

    max_bytes: int = 4 << 30
    ttl_s: float = 300.0
    max_blob_bytes: int = 1 << 30
    max_key_bytes: int = 512
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
    """Blobs by key, the memory account, the buffer pool and the waiting GETs (event-loop only)."""

    def __init__(self, cfg: RelayConfig) -> None:
        self.cfg = cfg
        self.entries: dict[str, Entry] = {}
        self.used = 0  # bytes of stored and in-flight blobs
        self.pool: dict[int, list[bytearray]] = defaultdict(list)
        self.pooled = 0
        self.waiters: dict[tuple[str, int], list[asyncio.Future]] = defaultdict(list)

    def reserve(self, size: int) -> bytearray | None:
        """Account `size` bytes and hand out a buffer, or None when over the cap."""
        if self.used + size > self.cfg.max_bytes:
            return None
        self.used += size
        free = self.pool.get(size)
        if free:
            self.pooled -= size
            return free.pop()
        return bytearray(size)

    def unreserve(self, buf: bytearray) -> None:
        self.used -= len(buf)
        if self.pooled + len(buf) <= self.cfg.pool_bytes:
            self.pool[len(buf)].append(buf)
            self.pooled += len(buf)

    def drop(self, blob: Blob) -> None:
        blob.dead = True
        if blob.readers == 0:
            self.unreserve(blob.buf)

    def put(self, key: str, index: int, blob: Blob) -> None:
        entry = self.entries.setdefault(key, Entry())
        entry.touched = time.monotonic()
        old = entry.blobs.pop(index, None)
        if old is not None:
            self.drop(old)
        entry.blobs[index] = blob
        for fut in self.waiters.pop((key, index), ()):
            if not fut.done():
                fut.set_result(None)

    def delete(self, key: str) -> int:
        entry = self.entries.pop(key, None)
        if entry is None:
            return 0
        for blob in entry.blobs.values():
            self.drop(blob)
        return len(entry.blobs)

    def expire(self) -> int:
        limit = time.monotonic() - self.cfg.ttl_s
        old = [k for k, e in self.entries.items() if e.touched < limit]
        for key in old:
            log.info("expired unclaimed key %s", key)
            self.delete(key)
        return len(old)

    def stat(self, key: str | None) -> dict:
        blobs = sum(len(e.blobs) for e in self.entries.values())
        out = {"keys": len(self.entries), "blobs": blobs, "used_bytes": self.used,
               "pool_bytes": self.pooled, "max_bytes": self.cfg.max_bytes}
        if key is not None:
            entry = self.entries.get(key)
            out["key_blobs"] = len(entry.blobs) if entry else 0
        return out


class Connection:
    """One client connection: a loop of request frames on a raw non-blocking socket."""

    def __init__(self, server: RelayServer, sock: socket.socket) -> None:
        self.store = server.store
        self.cfg = server.cfg
        self.loop = asyncio.get_running_loop()
        self.sock = sock
        self.pool = server.pool
        self.hdr = bytearray(wire.HEADER.size)

    async def recv_into(self, view: memoryview) -> None:
        if len(view) >= BULK_BYTES:
            return await self.loop.run_in_executor(self.pool, self._blocking, wire.recv_exact, view)
        got, n = 0, len(view)
        while got < n:
            k = await self.loop.sock_recv_into(self.sock, view[got:])
            if k == 0:
                raise ConnectionError("client closed the connection")
            got += k

    async def recv_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        await self.recv_into(memoryview(buf))
        return bytes(buf)

    async def reply(self, status: int, msg: str = "", *, size: int = 0, crc: int = 0, alg: int = 0,
                    flags: int = 0, payload: memoryview | bytes | None = None) -> None:
        text = msg.encode()[:60000]
        head = wire.Frame(status, alg, flags, len(text), 0, size, crc).pack() + text
        if payload is None or len(payload) < BULK_BYTES:
            await self.loop.sock_sendall(self.sock, head + bytes(payload or b""))
            return
        await self.loop.run_in_executor(self.pool, self._blocking, wire.send_all, [head, payload])

    def _blocking(self, fn: Callable[[socket.socket, Any], None], arg: Any) -> None:
        """Bulk I/O on a worker thread: one blocking MSG_WAITALL recv (or sendmsg) per blob instead of
        an event-loop wake-up per 64 KiB segment. Nothing else touches this socket meanwhile."""
        self.sock.setblocking(True)  # SO_RCVTIMEO/SO_SNDTIMEO set at accept bound a dead client
        try:
            fn(self.sock, arg)
        finally:
            self.sock.setblocking(False)

    async def handshake(self) -> None:
        nonce = secrets.token_bytes(wire.NONCE_BYTES)
        flags = wire.FLAG_AUTH_REQUIRED if self.cfg.secret else 0
        await self.reply(wire.ST_OK, size=len(nonce), flags=flags, payload=nonce)
        if not self.cfg.secret:
            return
        await self.recv_into(memoryview(self.hdr))
        f = wire.unpack(self.hdr)
        answer = await self.recv_bytes(min(f.size, 64)) if f.op == wire.OP_AUTH else b""
        if not hmac.compare_digest(answer, wire.auth_digest(self.cfg.secret, nonce)):
            await self.reply(wire.ST_AUTH, "relay secret does not match (AIRM_KV_TCP_SECRET)")
            raise ConnectionError("client failed the HMAC challenge")
        await self.reply(wire.ST_OK)

    async def serve(self) -> None:
        await self.handshake()
        while True:
            await self.recv_into(memoryview(self.hdr))
            f = wire.unpack(self.hdr)
            if f.klen > self.cfg.max_key_bytes:
                await self.reply(wire.ST_BAD, f"key of {f.klen} bytes exceeds the relay's "
                                              f"limit of {self.cfg.max_key_bytes}")
                raise ConnectionError("key too long")  # cannot resynchronise cheaply: drop the link
            key = (await self.recv_bytes(f.klen)).decode("utf-8", "replace")
            handler = {wire.OP_PUT: self.put, wire.OP_GET: self.get,
                       wire.OP_DEL: self.delete, wire.OP_STAT: self.stat}.get(f.op)
            if handler is None:
                await self.reply(wire.ST_BAD, f"unknown op {f.op}")
                raise ConnectionError("unknown op")
            await handler(f, key)

    async def discard(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            k = min(n, len(scratch))
            await self.recv_into(scratch[:k])
            n -= k

    async def put(self, f: wire.Frame, key: str) -> None:
        if f.size > self.cfg.max_blob_bytes:
            await self.discard(f.size)
            return await self.reply(wire.ST_TOO_LARGE, f"blob of {f.size} bytes exceeds the relay's "
                                                       f"limit of {self.cfg.max_blob_bytes} (--max-blob-mb)")
        buf = self.store.reserve(f.size)
        if buf is None:
            await self.discard(f.size)
            return await self.reply(wire.ST_CAPACITY, f"relay memory cap reached ({self.store.used} of "
                                                      f"{self.cfg.max_bytes} bytes in use); release keys "
                                                      "or raise --max-mb")
        try:
            await self.recv_into(memoryview(buf))
        except BaseException:
            self.store.unreserve(buf)
            raise
        if f.alg and wire.blob_crc(f.alg, memoryview(buf)) != f.crc:
            self.store.unreserve(buf)
            return await self.reply(wire.ST_INTEGRITY, f"checksum mismatch on blob {f.index} of {key} "
                                                       "as received by the relay")
        if self.cfg.log_blobs:
            log.info("put %s[%d] %d bytes sha256=%s", key, f.index, f.size, hashlib.sha256(buf).hexdigest())
        self.store.put(key, f.index, Blob(buf, f.size, f.crc, f.alg))
        await self.reply(wire.ST_OK)

    async def get(self, f: wire.Frame, key: str) -> None:
        blob = await self.wait_for(key, f.index, f.timeout_ms / 1000.0)
        if blob is None:
            return await self.reply(wire.ST_TIMEOUT, f"blob {f.index} of {key} did not arrive within "
                                                     f"{f.timeout_ms} ms")
        if blob.size > f.size:
            return await self.reply(wire.ST_TOO_LARGE, f"blob {f.index} of {key} has {blob.size} bytes, "
                                                       f"the output buffer only {f.size}", size=blob.size)
        self.store.entries[key].touched = time.monotonic()
        blob.readers += 1
        try:
            await self.reply(wire.ST_OK, size=blob.size, crc=blob.crc, alg=blob.alg,
                             payload=memoryview(blob.buf)[: blob.size])
        finally:
            blob.readers -= 1
            if blob.dead and blob.readers == 0:
                self.store.unreserve(blob.buf)

    async def wait_for(self, key: str, index: int, timeout: float) -> Blob | None:
        deadline = self.loop.time() + timeout
        while True:
            entry = self.store.entries.get(key)
            if entry is not None and index in entry.blobs:
                return entry.blobs[index]
            remaining = deadline - self.loop.time()
            if remaining <= 0:
                return None
            fut = self.loop.create_future()
            self.store.waiters[(key, index)].append(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                waiting = self.store.waiters.get((key, index), [])
                if fut in waiting:
                    waiting.remove(fut)
                if not waiting:
                    self.store.waiters.pop((key, index), None)

    async def delete(self, f: wire.Frame, key: str) -> None:
        await self.reply(wire.ST_OK, size=0, crc=self.store.delete(key))

    async def stat(self, f: wire.Frame, key: str) -> None:
        body = json.dumps(self.store.stat(key if f.flags else None)).encode()
        await self.reply(wire.ST_OK, size=len(body), payload=body)


class RelayServer:
    """Listens on (host, port); `serve_forever` runs until cancelled."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, cfg: RelayConfig | None = None) -> None:
        self.cfg = cfg or RelayConfig()
        self.store = Store(self.cfg)
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=256)
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kv-relay-io")

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        sweeper = loop.create_task(self._sweep())
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                conn, _ = await loop.sock_accept(self.sock)
                wire.tune_socket(conn)
                wire.set_io_timeout(conn, IO_TIMEOUT_S)
                conn.setblocking(False)
                task = loop.create_task(self._run(conn))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            sweeper.cancel()
            for task in list(tasks):
                task.cancel()
            self.sock.close()
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, conn: socket.socket) -> None:
        try:
            await Connection(self, conn).serve()
        except (ConnectionError, wire.WireError, OSError) as e:
            log.debug("connection closed: %s", e)
        finally:
            conn.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.cfg.ttl_s / 4)))
            self.store.expire()


def config_from_env(**overrides: object) -> RelayConfig:
    """RelayConfig with AIRM_KV_TCP_TTL_S / AIRM_KV_TCP_LOG / AIRM_KV_TCP_SECRET applied, then overrides."""
    cfg = RelayConfig(
        ttl_s=float(os.environ.get("AIRM_KV_TCP_TTL_S", RelayConfig.ttl_s)),
        log_blobs=os.environ.get("AIRM_KV_TCP_LOG", "0") == "1",
        secret=os.environ.get("AIRM_KV_TCP_SECRET", "").encode() or None,
    )
    for name, value in overrides.items():
        if value is not None:
            setattr(cfg, name, value)
    return cfg
