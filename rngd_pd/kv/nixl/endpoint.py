"""This process's NIXL side for the nixl-ucx transport: one agent, one registered arena, slot bookkeeping.

Why it is process-wide: NIXL agents are slow to create and UCX reads its settings once, and a pushed
slot must outlive the transport object that pushed it (the decode side may READ it later), so every
NixlUcxTransport of a process shares one `Endpoint`. Its background thread turns READ notifications
(`FREE_PREFIX` + slot token) into freed slots and expires slots nobody read.
"""

from __future__ import annotations

import atexit
import base64
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass

from rngd_pd.errors import TransportCapacityError, TransportError
from rngd_pd.kv.nixl.agent import SlotAllocator, alloc_arena, process_agent, register_arena

log = logging.getLogger("rngd_pd.kv.nixl.ucx")

FREE_PREFIX = b"rngd-free:"  # READ notification: the pusher frees the slot named after the prefix
NOTIF_POLL_S = 0.0005  # while slots wait to be read
IDLE_POLL_S = 0.1
EXPIRY_SCAN_S = 0.1  # unread slots expire after seconds: scanning them on every 0.5 ms poll only burns CPU


@dataclass
class Slot:
    key: str
    offset: int
    nbytes: int
    expires: float


class Endpoint:
    """This process's NIXL side: the agent, the registered arena, pushed slots, the notification thread."""

    def __init__(self, pool_bytes: int) -> None:
        self.agent = process_agent()
        self.arena = alloc_arena(pool_bytes)
        self.registration = register_arena(self.agent, self.arena)
        self.base = self.arena.ctypes.data
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.lock = threading.Lock()
        self._freed = threading.Condition(self.lock)
        self.allocator = SlotAllocator(pool_bytes)
        self.slots: dict[str, Slot] = {}  # token -> a pushed slot not yet read
        self.remotes: set[str] = set()
        self._remote_lock = threading.Lock()
        self.quarantined = 0  # bytes of slots a READ that could not be cancelled may still write
        self._tokens = itertools.count(1)
        self._next_expiry_scan = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="nixl-ucx-notifs", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    # slots ------------------------------------------------------------------------------------------

    def reserve(self, nbytes: int, key: str, wait_s: float) -> int:
        """An arena range for `nbytes`, waiting up to `wait_s` for reads to free room (backpressure);
        TransportCapacityError when there is still none."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            while True:
                off = self.allocator.alloc(nbytes)
                if off is not None:
                    return off
                remaining = deadline - time.monotonic()
                if remaining <= 0 or nbytes > self.allocator.size:
                    break
                self._wake.set()  # the notification thread frees what was read
                self._freed.wait(min(remaining, 0.05))
        raise TransportCapacityError(
            f"nixl-ucx arena full: {nbytes} bytes needed, {self.allocator.used} of {self.allocator.size} "
            f"in use after waiting {wait_s:g} s; pull and release keys sooner, lower AIRM_KV_TCP_TTL_S "
            "or raise AIRM_KV_UCX_POOL_MB", key=key)

    def unreserve(self, offset: int, nbytes: int) -> None:
        with self.lock:
            self.allocator.free(offset, nbytes)
            self._freed.notify_all()

    def publish(self, key: str, offset: int, nbytes: int, ttl_s: float) -> str:
        """Record a pushed slot until a READ notification or its expiry frees it; returns its token."""
        with self.lock:
            token = f"{os.getpid()}.{next(self._tokens)}"
            self.slots[token] = Slot(key, offset, nbytes, time.monotonic() + ttl_s)
        self._wake.set()
        return token

    def free_token(self, token: str) -> None:
        with self.lock:
            slot = self.slots.pop(token, None)
            if slot is not None:
                self.allocator.free(slot.offset, slot.nbytes)
                self._freed.notify_all()

    def drop_key(self, key: str) -> None:
        with self.lock:
            for token in [t for t, s in self.slots.items() if s.key == key]:
                slot = self.slots.pop(token)
                self.allocator.free(slot.offset, slot.nbytes)
            self._freed.notify_all()

    def quarantine(self, nbytes: int) -> None:
        """Never hand out a slot again: a READ that could not be cancelled may still write into it."""
        with self.lock:
            self.quarantined += nbytes
        log.error("nixl-ucx: %d arena bytes withheld after a READ that could not be cancelled", nbytes)

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
        if now < self._next_expiry_scan:
            return
        self._next_expiry_scan = now + EXPIRY_SCAN_S
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
        with self._remote_lock:
            if name in self.remotes or name == self.agent.name:  # ourselves: a loopback READ
                return name
            try:
                added = self.agent.add_remote_agent(base64.b64decode(metadata_b64))
            except Exception as exc:
                raise TransportError(f"cannot add NIXL agent {name!r} from its descriptor: {exc}",
                                     key=key) from None
            self.remotes.add(added)
            return added

    def forget(self, name: str) -> None:
        """Drop a remote agent whose READ failed (its process likely died); re-added if seen again."""
        with self._remote_lock:
            if name in self.remotes:
                self.remotes.discard(name)
                try:
                    self.agent.remove_remote_agent(name)
                except Exception as exc:
                    log.info("nixl-ucx: removing agent %s failed: %s", name, exc)


_endpoint: Endpoint | None = None
_endpoint_lock = threading.Lock()


def endpoint(pool_bytes: int) -> Endpoint:
    """The process's endpoint, created (agent + arena registration) by the first transport."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None:
            _endpoint = Endpoint(pool_bytes)
        elif _endpoint.allocator.size != pool_bytes:
            log.info("nixl-ucx: arena already registered with %d bytes; keeping it", _endpoint.allocator.size)
        return _endpoint


def current() -> Endpoint | None:
    """The endpoint if this process created one (for storage probes), else None."""
    return _endpoint
