"""The relay's frame format, shared by the server (server.py) and the client (tcp.py).

Every message starts with one fixed 32-byte header, network byte order:

    magic "RKVR" | version u8 | op/status u8 | checksum alg u8 | flags u8 | key/message length u16 |
    reserved u16 | blob index u32 | size u64 | checksum u32 | timeout ms u32

followed by the key (request) or an error message (response) of that length, then `size` payload bytes
where the op carries a payload (PUT request, GET response, STAT response, HELLO nonce). A peer with
another magic or version is refused before anything else is read.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass

from rngd_pd.kv.buffers import checksum

MAGIC = b"RKVR"
VERSION = 1
HEADER = struct.Struct("!4sBBBBHHIQII")
assert HEADER.size == 32

# ops (requests) ...
OP_HELLO, OP_AUTH, OP_PUT, OP_GET, OP_DEL, OP_STAT = 1, 2, 3, 4, 5, 6
# ... and statuses (responses)
ST_OK, ST_TIMEOUT, ST_INTEGRITY, ST_CAPACITY, ST_TOO_LARGE, ST_BAD, ST_AUTH = 0, 1, 2, 3, 4, 5, 6
STATUS_NAMES = {
    ST_OK: "ok", ST_TIMEOUT: "timeout", ST_INTEGRITY: "integrity", ST_CAPACITY: "capacity",
    ST_TOO_LARGE: "too large", ST_BAD: "bad request", ST_AUTH: "auth",
}
FLAG_AUTH_REQUIRED = 1

# checksum algorithm ids on the wire (0 = none: AIRM_KV_TCP_CRC=0)
ALG_IDS = {None: 0, "crc32": 1, "crc32c": 2}
ALG_NAMES = {v: k for k, v in ALG_IDS.items()}

NONCE_BYTES = 32
MAX_KEY_BYTES = 512  # a request key longer than this is refused by the relay and its client


@dataclass
class Frame:
    """One decoded header."""

    op: int
    alg: int = 0
    flags: int = 0
    klen: int = 0
    index: int = 0
    size: int = 0
    crc: int = 0
    timeout_ms: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.op, self.alg, self.flags, self.klen, 0,
                           self.index, self.size, self.crc, self.timeout_ms)


class WireError(Exception):
    """A peer that does not speak this protocol (bad magic/version) or a malformed frame."""


def unpack(raw: bytes | bytearray | memoryview) -> Frame:
    """Decode a header; refuse another magic or version first."""
    magic, version, op, alg, flags, klen, _, index, size, crc, tmo = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError(f"not a KV relay frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise WireError(f"KV relay protocol version {version}, this side speaks {VERSION}")
    return Frame(op, alg, flags, klen, index, size, crc, tmo)


def blob_crc(alg: int, data: memoryview) -> int:
    """The wire checksum of a payload (0 when alg is 0 = checks off)."""
    name = ALG_NAMES.get(alg)
    return checksum(data, name) & 0xFFFFFFFF if name else 0


def auth_digest(secret: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 response to the server's per-connection challenge: the secret never crosses."""
    return hmac.new(secret, b"rngd-kv-relay/1:" + nonce, hashlib.sha256).digest()


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay for small frames; large kernel buffers so 1 MiB blobs flow in few syscalls."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
        except OSError:
            pass


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Kernel-side send/receive timeouts on a *blocking* socket.

    Python's own `settimeout` makes the socket non-blocking and polls, which defeats MSG_WAITALL;
    SO_RCVTIMEO keeps one blocking recv per blob and still bounds a dead peer.
    """
    sock.setblocking(True)
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from a blocking socket: usually one MSG_WAITALL syscall for a whole blob."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except BlockingIOError:  # SO_RCVTIMEO expired
            raise TimeoutError("timed out waiting for the peer") from None
        if k == 0:
            raise ConnectionError("the peer closed the connection")
        got += k


def send_all(sock: socket.socket, parts: list) -> None:
    """sendmsg of several buffers on a blocking socket, resumed after partial sends (no joins)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:  # SO_SNDTIMEO expired
            raise TimeoutError("timed out sending to the peer") from None
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
