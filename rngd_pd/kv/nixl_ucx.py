"""`nixl-ucx` transport: one-sided NIXL READs over UCX, descriptors through the KV relay.

The cross-node path that becomes RDMA by configuration: the bytes move with whatever UCX picks from its
environment (TCP today, `UCX_TLS=rc,...` on an RDMA NIC), the code stays the same.

* Each process has one NIXL agent and registers one pre-faulted host arena once
  (`AIRM_KV_UCX_POOL_MB`, default 1024; the first transport of the process sizes it).
* push copies the blob into an arena slot and puts a small JSON descriptor (agent name + metadata,
  address, length, checksum, slot token) under the blob's (key, index) in the relay
  (`AIRM_KV_TCP_ADDR`, the same `rngd-pd kv-relay` the tcp transport uses).
* pull waits for the descriptor, adds the remote agent once, READs the bytes into a slot of its own
  arena, checks the checksum, copies them into the caller's buffer. The READ carries a notification
  that frees the pusher's slot; a background thread in the pushing process serves those. Slots
  nobody reads expire after `AIRM_KV_TCP_TTL_S`.
* Full arena -> TransportCapacityError; failed READ -> TransportError; checksum mismatch ->
  TransportIntegrityError. Never a fallback. The pushing process must stay up until decode has read.
* `AIRM_KV_UCX_LOG=1` logs size and SHA-256 per blob.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rngd_pd.errors import TransportCapacityError, TransportError, TransportIntegrityError
from rngd_pd.kv.buffers import as_bytes, as_writable_bytes, checksum
from rngd_pd.kv.protocol import ConformanceCase
from rngd_pd.kv.tcp import RelayClient, crc_from_env
from rngd_pd.kv.ucx import SlotAllocator, alloc_arena, apply_ucx_env, process_agent, register_arena, wait_xfer

log = logging.getLogger("rngd_pd.kv.nixl_ucx")

DESCRIPTOR_VERSION = 1
DESCRIPTOR_MAX_BYTES = 64 << 10
FREE_PREFIX = b"rngd-free:"  # READ notification: the pusher frees the slot named after the prefix
READ_GRACE_S = 5.0  # a READ whose descriptor arrived at the end of the timeout still gets this long
NOTIF_POLL_S = 0.0005  # while slots wait to be read
IDLE_POLL_S = 0.1


@dataclass
class _Slot:
    key: str
    offset: int
    nbytes: int
    expires: float


class _StuckReadError(TransportError):
    """A READ that timed out and could not be cancelled: its target slot must never be reused."""


class _Endpoint:
    """This process's NIXL side: the agent, the registered arena, pushed slots, the notification thread."""

    def __init__(self, pool_bytes: int) -> None:
        self.agent = process_agent()
        self.arena = alloc_arena(pool_bytes)
        self.registration = register_arena(self.agent, self.arena)
        self.base = self.arena.ctypes.data
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.lock = threading.Lock()
        self.allocator = SlotAllocator(pool_bytes)
        self.slots: dict[str, _Slot] = {}  # token -> a pushed slot not yet read
        self.remotes: set[str] = set()
        self.quarantined = 0  # bytes of slots a READ that could not be cancelled may still write
        self._tokens = itertools.count(1)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-ucx-notifs", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    # slots ------------------------------------------------------------------------------------------

    def reserve(self, nbytes: int, key: str) -> int:
        """An arena range for `nbytes`; TransportCapacityError if full even after freeing what we can."""
        for attempt in range(2):
            with self.lock:
                off = self.allocator.alloc(nbytes)
            if off is not None:
                return off
            if attempt == 0:
                self.poll()  # read notifications and expiries may free room right now
        raise TransportCapacityError(
            f"nixl-ucx arena full: {nbytes} bytes needed, {self.allocator.used} of {self.allocator.size} "
            "in use; pull and release keys sooner, lower AIRM_KV_TCP_TTL_S or raise AIRM_KV_UCX_POOL_MB",
            key=key)

    def unreserve(self, offset: int, nbytes: int) -> None:
        with self.lock:
            self.allocator.free(offset, nbytes)

    def publish(self, key: str, offset: int, nbytes: int, ttl_s: float) -> str:
        """Record a pushed slot until a READ notification or its expiry frees it; returns its token."""
        with self.lock:
            token = f"{os.getpid()}.{next(self._tokens)}"
            self.slots[token] = _Slot(key, offset, nbytes, time.monotonic() + ttl_s)
        self._wake.set()
        return token

    def free_token(self, token: str) -> None:
        with self.lock:
            slot = self.slots.pop(token, None)
            if slot is not None:
                self.allocator.free(slot.offset, slot.nbytes)

    def drop_key(self, key: str) -> None:
        with self.lock:
            for token in [t for t, s in self.slots.items() if s.key == key]:
                slot = self.slots.pop(token)
                self.allocator.free(slot.offset, slot.nbytes)

    def held(self, key: str | None = None) -> tuple[int, int]:
        """(slots, bytes) pushed from this process and not yet read, for one key or all."""
        with self.lock:
            slots = [s for s in self.slots.values() if key is None or s.key == key]
        return len(slots), sum(s.nbytes for s in slots)

    # notifications ----------------------------------------------------------------------------------

    def poll(self) -> None:
        """Free slots named by READ notifications, then slots past their expiry."""
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as exc:  # keep serving; a broken agent shows up as READ failures on the peer
            log.warning("nixl-ucx: reading notifications failed: %s", exc)
            notifs = {}
        for messages in notifs.values():
            for msg in messages:
                if msg.startswith(FREE_PREFIX):
                    self.free_token(msg[len(FREE_PREFIX):].decode())
        now = time.monotonic()
        with self.lock:
            expired = [t for t, s in self.slots.items() if s.expires <= now]
        for token in expired:
            self.free_token(token)
        if expired:
            log.info("nixl-ucx: %d unread slot(s) expired", len(expired))

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.poll()
            if self.slots:
                time.sleep(NOTIF_POLL_S)
            else:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2)

    # peers ------------------------------------------------------------------------------------------

    def remote(self, name: str, metadata_b64: str, key: str) -> str:
        """Add a remote agent the first time we see it (its metadata travels in the descriptor)."""
        with self.lock:
            if name in self.remotes or name == self.agent.name:  # ourselves: a loopback READ
                return name
            try:
                added = self.agent.add_remote_agent(base64.b64decode(metadata_b64))
            except Exception as exc:
                raise TransportError(f"cannot add NIXL agent {name!r} from its descriptor: {exc}",
                                     key=key) from None
            self.remotes.add(added)
            return added


_endpoint: _Endpoint | None = None
_endpoint_lock = threading.Lock()


def endpoint(pool_bytes: int) -> _Endpoint:
    """The process's endpoint, created (agent + arena registration) by the first transport."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None:
            _endpoint = _Endpoint(pool_bytes)
        elif _endpoint.allocator.size != pool_bytes:
            log.info("nixl-ucx: arena already registered with %d bytes; keeping it", _endpoint.allocator.size)
        return _endpoint


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _log_blob(what: str, key: str, index: int, data: Any) -> None:
    log.info("%s %s[%d] %d bytes sha256=%s", what, key, index, len(data), hashlib.sha256(data).hexdigest())


class NixlUcxTransport:
    """The Transport protocol over NIXL READs (see the module docstring for the data path)."""

    name = "nixl-ucx"

    def __init__(self, addr: str | tuple[str, int] | None = None, secret: str | bytes | None = None, *,
                 pool_mb: int | None = None, ttl_s: float | None = None, crc: str | bool | None = True,
                 log_blobs: bool | None = None, ucx_env: dict[str, str] | None = None) -> None:
        self.ttl_s = float(ttl_s if ttl_s is not None else os.environ.get("AIRM_KV_TCP_TTL_S", "300"))
        pool_mb = int(pool_mb if pool_mb is not None else os.environ.get("AIRM_KV_UCX_POOL_MB", "1024"))
        if pool_mb <= 0 or self.ttl_s <= 0:
            raise TransportError(f"AIRM_KV_UCX_POOL_MB ({pool_mb}) and AIRM_KV_TCP_TTL_S ({self.ttl_s}) "
                                 "must be positive")
        self.alg = crc_from_env() if crc is True else (crc or None)
        self.log_blobs = _env_flag("AIRM_KV_UCX_LOG") if log_blobs is None else log_blobs
        self.relay = RelayClient(addr, secret)  # first: a missing relay address fails before NIXL starts
        apply_ucx_env(ucx_env)  # effective only if this process has no agent yet
        self.ep = endpoint(pool_mb << 20)
        self._closed = False

    def push(self, key: str, index: int, data: Any) -> None:
        """Copy into an arena slot and publish its descriptor; the slot lives until read or expired."""
        self._check_open(key)
        view = as_bytes(data)
        n = len(view)
        token, crc, offset = "", 0, 0
        if n:
            offset = self.ep.reserve(n, key)
            try:
                slot = self.ep.arena[offset: offset + n]
                slot[:] = np.frombuffer(view, dtype=np.uint8)
                crc = checksum(slot, self.alg) if self.alg else 0
            except BaseException:
                self.ep.unreserve(offset, n)
                raise
            token = self.ep.publish(key, offset, n, self.ttl_s)
            if self.log_blobs:
                _log_blob("push", key, index, slot)
        desc = {"v": DESCRIPTOR_VERSION, "agent": self.ep.agent.name, "md": self.ep.metadata,
                "addr": self.ep.base + offset, "len": n, "alg": self.alg, "crc": crc, "token": token}
        try:
            self.relay.put(key, index, json.dumps(desc).encode())
        except BaseException:
            if token:
                self.ep.free_token(token)
            raise

    def pull(self, key: str, index: int, out: Any, timeout: float) -> int:
        """Wait for the descriptor, READ the bytes, verify, copy into `out`; returns the blob's size."""
        self._check_open(key)
        deadline = time.monotonic() + timeout
        view = as_writable_bytes(out)
        desc = self._descriptor(key, index, timeout)
        n = desc["len"]
        if n > len(view):
            raise TransportIntegrityError(f"blob {index} has {n} bytes but the output buffer only "
                                          f"{len(view)}; preallocate from the KV handle's sizes", key=key)
        if n == 0:
            return 0
        peer = self.ep.remote(desc["agent"], desc["md"], key)
        offset = self.ep.reserve(n, key)
        try:
            self._read(peer, offset, desc, key, index, max(deadline, time.monotonic() + READ_GRACE_S))
            local = self.ep.arena[offset: offset + n]
            if desc["alg"] and checksum(local, desc["alg"]) != desc["crc"]:
                raise TransportIntegrityError(
                    f"checksum ({desc['alg']}) mismatch on blob {index} read from NIXL agent "
                    f"{desc['agent']}: the pusher's slot changed or was freed before the READ", key=key)
            np.frombuffer(view, dtype=np.uint8, count=n)[:] = local
            if self.log_blobs:
                _log_blob("pull", key, index, local)
        except _StuckReadError:
            with self.ep.lock:
                self.ep.quarantined += n  # UCX may still write into this slot: never hand it out again
            raise
        except BaseException:
            self.ep.unreserve(offset, n)
            raise
        self.ep.unreserve(offset, n)
        return n

    def _descriptor(self, key: str, index: int, timeout: float) -> dict[str, Any]:
        raw = self.relay.get(key, index, timeout, DESCRIPTOR_MAX_BYTES)
        try:
            desc = json.loads(raw)
            if desc.get("v") != DESCRIPTOR_VERSION:
                raise ValueError(f"descriptor version {desc.get('v')!r}, expected {DESCRIPTOR_VERSION}")
            missing = [f for f in ("agent", "md", "addr", "len", "alg", "crc", "token") if f not in desc]
            if missing:
                raise ValueError(f"fields {missing} missing")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TransportIntegrityError(
                f"blob {index} has no valid nixl-ucx descriptor in the relay ({exc}); "
                "was it pushed with another transport?", key=key) from None
        return desc

    def _read(self, peer: str, offset: int, desc: dict[str, Any], key: str, index: int,
              deadline: float) -> None:
        """One-sided READ of the pusher's slot into ours; its notification frees the pusher's slot."""
        agent, n = self.ep.agent, desc["len"]
        try:
            local = agent.get_xfer_descs([(self.ep.base + offset, n, 0)], "DRAM")
            remote = agent.get_xfer_descs([(desc["addr"], n, 0)], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, peer, FREE_PREFIX + desc["token"].encode())
            state = agent.transfer(handle)
        except Exception as exc:
            raise TransportError(f"NIXL READ of blob {index} from agent {peer} could not start: {exc}",
                                 key=key) from None
        if state != "ERR":
            state = wait_xfer(agent, handle, deadline)
        try:
            handle.release()  # cancels a READ still running
        except Exception:
            if state == "TIMEOUT":
                raise _StuckReadError(f"NIXL READ of blob {index} from agent {peer} timed out and could "
                                      f"not be cancelled; {n} arena bytes withheld", key=key) from None
        if state != "DONE":
            raise TransportError(f"NIXL READ of blob {index} from agent {peer} failed ({state}); is the "
                                 "pushing process still running?", key=key)

    def release(self, key: str) -> None:
        """Drop the key's descriptors from the relay and any unread slots this process pushed for it."""
        self._check_open(key)
        self.ep.drop_key(key)
        self.relay.delete(key)

    def held(self, key: str | None = None) -> tuple[int, int]:
        """(slots, bytes) this process pushed and nobody has read yet (all keys if `key` is None)."""
        return self.ep.held(key)

    def close(self) -> None:
        """Close the relay connection. The process's agent and arena stay for the next transport."""
        if not self._closed:
            self._closed = True
            self.relay.close()

    def _check_open(self, key: str) -> None:
        if self._closed:
            raise TransportError("this nixl-ucx transport is closed", key=key)

    def __enter__(self) -> NixlUcxTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    @contextlib.contextmanager
    def conformance_case(cls) -> Iterator[ConformanceCase]:
        """Relays on free loopback ports (one with a 0.5 s TTL for the expiry case), 256 MiB arenas.

        A blob counts as stored while its slot is held in this process or its descriptor is in a relay.
        """
        from rngd_pd.kv.relayproc import start_relay

        with contextlib.ExitStack() as stack:
            relay = stack.enter_context(start_relay())
            ttl_relay = stack.enter_context(start_relay("127.0.0.1", 0, "--ttl-s", "0.5"))
            probes = [stack.enter_context(RelayClient(r.addr)) for r in (relay, ttl_relay)]

            def stored_blobs(key: str) -> int:
                slots = _endpoint.held(key)[0] if _endpoint else 0
                return max(slots, sum(p.stat(key)["key_blobs"] for p in probes))

            yield ConformanceCase(
                options={"addr": relay.addr, "pool_mb": 256}, env={"AIRM_KV_TCP_ADDR": relay.addr},
                ttl_s=0.5, ttl_options={"addr": ttl_relay.addr, "ttl_s": 0.5}, corrupt=_corrupt_slot,
                stored_blobs=stored_blobs, stored_bytes=lambda: _endpoint.held()[1] if _endpoint else 0)


def _corrupt_slot(t: NixlUcxTransport, key: str, index: int, data: bytes) -> None:
    """Push `data`, then flip one byte of its arena slot after the checksum was published."""
    t.push(key, index, data)
    with t.ep.lock:
        slot = [s for s in t.ep.slots.values() if s.key == key][-1]
        t.ep.arena[slot.offset] ^= 0xFF
