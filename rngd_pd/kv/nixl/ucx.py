"""`nixl-ucx` transport: one-sided NIXL READs over UCX, descriptors through the KV relay.

The cross-node path that becomes RDMA by configuration: the bytes move with whatever UCX picks from its
environment (TCP today, `UCX_TLS=rc,...` on an RDMA NIC), the code stays the same.

* Each process has one NIXL agent and registers one pre-faulted host arena once
  (`AIRM_KV_UCX_POOL_MB`, default 1024; the first transport of the process sizes it), see
  `rngd_pd.kv.nixl.endpoint`.
* push copies the blob into an arena slot and returns; a background thread puts a small JSON
  descriptor (agent name + metadata, address, length, checksum, slot token) under the blob's
  (key, index) in the relay (`AIRM_KV_TCP_ADDR`, the same `rngd-pd kv-relay` the tcp transport uses),
  in push order (`rngd_pd.kv.nixl.publish`). A full arena waits up to `capacity_wait_s` for reads to
  free room, then raises TransportCapacityError.
* pull waits for the descriptor, adds the remote agent once, READs the bytes into a slot of its own
  arena, checks the checksum, copies them into the caller's buffer. The READ carries a notification
  that frees the pusher's slot; a background thread in the pushing process serves those. Slots
  nobody reads expire after `AIRM_KV_TCP_TTL_S`. Blobs are read once: a second pull of the same blob
  may find its slot reused (a checksum error, never wrong bytes).
* Read-ahead (`AIRM_KV_UCX_READ_AHEAD`, default 2): a pull also posts READs for the next blobs of the
  key whose descriptors are already there, so their transfer overlaps this blob's checksum and copy.
* Failed READ -> TransportError; checksum mismatch -> TransportIntegrityError. Never a fallback. The
  pushing process must stay up until decode has read.
* `AIRM_KV_UCX_LOG=1` logs size and SHA-256 per blob.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rngd_pd.config.env import AIRM_KV_TCP_ADDR
from rngd_pd.errors import TransportError, TransportIntegrityError
from rngd_pd.kv.buffers import as_bytes, as_writable_bytes, checksum
from rngd_pd.kv.nixl import endpoint
from rngd_pd.kv.nixl.agent import apply_ucx_env, progress_delay_us, wait_xfer
from rngd_pd.kv.nixl.endpoint import FREE_PREFIX
from rngd_pd.kv.nixl.publish import Publisher
from rngd_pd.kv.options import UcxOptions, at_least, crc_algorithm, options
from rngd_pd.kv.protocol import Closing, ConformanceCase
from rngd_pd.kv.relay.proc import start_relay
from rngd_pd.kv.relay.tcp import RelayClient

log = logging.getLogger("rngd_pd.kv.nixl.ucx")

DESCRIPTOR_VERSION = 1
DESCRIPTOR_MAX_BYTES = 64 << 10
DESCRIPTOR_FIELDS = ("agent", "md", "addr", "len", "alg", "crc", "token")
READ_GRACE_S = 5.0  # a READ whose descriptor arrived at the end of the timeout still gets this long
# Descriptors are read ahead one GET at a time on the relay connection, so when a pull had to fetch
# its own descriptor (the first blob, or after a gap) the next answers are just being sent: the
# read-ahead waits this long for them, while this pull's READ is in flight, instead of skipping them.
CHAIN_START_WAIT_S = 0.002


@dataclass
class _Read:
    """A READ posted into our arena; the pull of its (key, index) waits for it and consumes it."""

    desc: dict[str, Any]
    offset: int
    handle: Any
    state: str  # what posting it returned: DONE, PROC or ERR
    posted: float






def _log_blob(what: str, key: str, index: int, data: Any) -> None:
    log.info("%s %s[%d] %d bytes sha256=%s", what, key, index, len(data), hashlib.sha256(data).hexdigest())


class NixlUcxTransport(Closing):
    """The Transport protocol over NIXL READs (see the module docstring for the data path)."""

    name = "nixl-ucx"

    def __init__(self, addr: str | tuple[str, int] | None = None, secret: str | bytes | None = None, *,
                 pool_mb: int | None = None, ttl_s: float | None = None, crc: str | bool | None = True,
                 log_blobs: bool | None = None, ucx_env: dict[str, str] | None = None,
                 capacity_wait_s: float = 2.0, read_ahead: int | None = None,
                 config: Mapping[str, str] | str | None = None) -> None:
        o = options(UcxOptions, self.name, config, ttl_s=ttl_s, pool_mb=pool_mb, read_ahead=read_ahead,
                    log_blobs=log_blobs)
        at_least(o, self.name, ttl_s=1e-3, pool_mb=1, read_ahead=0)
        self.ttl_s, self.read_ahead, self.log_blobs = o.ttl_s, o.read_ahead, o.log_blobs
        self.alg = crc_algorithm(o.crc) if crc is True else crc_algorithm(crc)
        self.capacity_wait_s = capacity_wait_s
        progress_delay_us()  # a bad setting fails here, before the relay or NIXL is touched
        # first: a missing relay address fails before NIXL starts
        # the relay connection keeps its own settings (AIRM_KV_TCP_LOG, ...); only where it is comes from ours
        self.relay = RelayClient(addr or o.addr, secret if secret is not None else o.secret)
        apply_ucx_env(ucx_env)  # effective only if this process has no agent yet
        self.ep = endpoint.endpoint(o.pool_mb << 20)
        self.publisher = Publisher(self.relay, self.ep.free_token)
        self._ahead: dict[tuple[str, int], _Read] = {}
        self._ahead_lock = threading.Lock()
        self._closed = False

    # push -------------------------------------------------------------------------------------------

    def push(self, key: str, index: int, data: Any) -> None:
        """Copy into an arena slot, queue its descriptor for the relay; the slot lives until read or expired.

        Returns once the bytes are in the arena; the descriptor follows in push order (`flush` waits for
        it). A failed publication is raised by the next push or flush."""
        self._check_open(key)
        view = as_bytes(data)
        n = len(view)
        token, crc, offset = "", 0, 0
        if n:
            offset = self.ep.reserve(n, key, self.capacity_wait_s)
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
            self.publisher.submit(key, index, json.dumps(desc).encode(), token)
        except BaseException:
            if token:
                self.ep.free_token(token)
            raise

    def flush(self, key: str | None = None, timeout: float = 30.0) -> None:
        """Wait until every pushed blob's descriptor is in the relay (push returns before that);
        `key` is accepted for the protocol's `flush(key)`, but every queued descriptor is waited for."""
        self.publisher.flush(timeout)

    # pull -------------------------------------------------------------------------------------------

    def pull(self, key: str, index: int, out: Any, timeout: float) -> int:
        """Wait for the descriptor, READ the bytes, verify, copy into `out`; returns the blob's size."""
        self._check_open(key)
        deadline = time.monotonic() + timeout
        view = as_writable_bytes(out)
        with self._ahead_lock:
            rd = self._ahead.pop((key, index), None)
        started = rd is None  # the descriptor chain starts here: its next answers are just on their way
        if rd is None:
            desc = self._descriptor(key, index, timeout)
            self._check_fits(desc["len"], view, key, index)
            if desc["len"] == 0:
                return 0
            rd = self._post(key, index, desc, self.capacity_wait_s)
        if self.read_ahead:
            self._prefetch(key, index, CHAIN_START_WAIT_S if started else 0.0)
        return self._finish(rd, key, index, view, max(deadline, time.monotonic() + READ_GRACE_S))

    def _descriptor(self, key: str, index: int, timeout: float) -> dict[str, Any]:
        raw = self.relay.get(key, index, timeout, DESCRIPTOR_MAX_BYTES, read_ahead=True)
        try:
            desc = json.loads(raw)
            if desc.get("v") != DESCRIPTOR_VERSION:
                raise ValueError(f"descriptor version {desc.get('v')!r}, expected {DESCRIPTOR_VERSION}")
            missing = [f for f in DESCRIPTOR_FIELDS if f not in desc]
            if missing:
                raise ValueError(f"fields {missing} missing")
        except (ValueError, TypeError, AttributeError) as exc:
            raise TransportIntegrityError(
                f"blob {index} has no valid nixl-ucx descriptor in the relay ({exc}); "
                "was it pushed with another transport?", key=key) from None
        return desc

    @staticmethod
    def _check_fits(n: int, view: memoryview, key: str, index: int) -> None:
        if n > len(view):
            raise TransportIntegrityError(f"blob {index} has {n} bytes but the output buffer only "
                                          f"{len(view)}; preallocate from the KV handle's sizes", key=key)

    def _post(self, key: str, index: int, desc: dict[str, Any], wait_s: float) -> _Read:
        """Reserve a slot of our arena and post the one-sided READ of the pusher's slot into it."""
        peer = self.ep.remote(desc["agent"], desc["md"], key)
        n, agent = desc["len"], self.ep.agent
        offset = self.ep.reserve(n, key, wait_s)
        try:
            local = agent.get_xfer_descs([(self.ep.base + offset, n, 0)], "DRAM")
            remote = agent.get_xfer_descs([(desc["addr"], n, 0)], "DRAM")
            handle = agent.initialize_xfer("READ", local, remote, peer, FREE_PREFIX + desc["token"].encode())
            state = agent.transfer(handle)
        except Exception as exc:
            self.ep.unreserve(offset, n)
            raise TransportError(f"NIXL READ of blob {index} from agent {peer} could not start: {exc}",
                                 key=key) from None
        return _Read(desc, offset, handle, state, time.monotonic())

    def _wait(self, rd: _Read, key: str, index: int, deadline: float) -> None:
        """Wait for a posted READ; on failure its slot is freed (or withheld if UCX may still write it)."""
        state = rd.state if rd.state == "ERR" else wait_xfer(self.ep.agent, rd.handle, deadline)
        n = rd.desc["len"]
        try:
            rd.handle.release()  # cancels a READ still running
        except Exception:
            if state == "TIMEOUT":
                self.ep.quarantine(n)
                raise TransportError(f"NIXL READ of blob {index} from agent {rd.desc['agent']} timed "
                                     f"out and could not be cancelled; {n} arena bytes withheld",
                                     key=key) from None
        if state != "DONE":
            self.ep.unreserve(rd.offset, n)
            self.ep.forget(rd.desc["agent"])
            raise TransportError(f"NIXL READ of blob {index} from agent {rd.desc['agent']} failed ({state}); "
                                 "is the pushing process still running?", key=key)

    def _finish(self, rd: _Read, key: str, index: int, view: memoryview, deadline: float) -> int:
        """Wait for the READ, verify the checksum, copy into the caller's buffer, free our slot."""
        self._wait(rd, key, index, deadline)
        desc, n = rd.desc, rd.desc["len"]
        try:
            self._check_fits(n, view, key, index)
            local = self.ep.arena[rd.offset: rd.offset + n]
            if desc["alg"] and checksum(local, desc["alg"]) != desc["crc"]:
                raise TransportIntegrityError(
                    f"checksum ({desc['alg']}) mismatch on blob {index} read from NIXL agent "
                    f"{desc['agent']}: the pusher's slot changed or was freed before the READ", key=key)
            np.frombuffer(view, dtype=np.uint8, count=n)[:] = local
            if self.log_blobs:
                _log_blob("pull", key, index, local)
        finally:
            self.ep.unreserve(rd.offset, n)
        return n

    def _prefetch(self, key: str, index: int, wait_s: float) -> None:
        """Post READs for the next blobs of `key` whose descriptors are in the relay. `wait_s` bounds
        the wait for descriptor answers still in flight (our own READ is in flight meanwhile)."""
        self._sweep_ahead()
        deadline = time.monotonic() + wait_s
        for j in range(index + 1, index + 1 + self.read_ahead):
            with self._ahead_lock:
                if (key, j) in self._ahead:
                    continue
            try:
                desc = self._descriptor(key, j, max(0.0, deadline - time.monotonic()))
                if desc["len"] == 0:
                    return
                rd = self._post(key, j, desc, 0.0)
            except TransportError:  # not pushed yet, or no room: its own pull will wait or report
                return
            with self._ahead_lock:
                other = self._ahead.setdefault((key, j), rd)
            if other is not rd:  # another thread got there first
                self._discard(rd)

    def _discard(self, rd: _Read) -> None:
        """Let a read-ahead nobody will consume finish, then free its slot."""
        with contextlib.suppress(TransportError):
            self._wait(rd, "", -1, time.monotonic() + READ_GRACE_S)
            self.ep.unreserve(rd.offset, rd.desc["len"])

    def _drop_ahead(self, match: Any) -> None:
        with self._ahead_lock:
            gone = [k for k in self._ahead if match(k)]
            reads = [self._ahead.pop(k) for k in gone]
        for rd in reads:
            self._discard(rd)

    def _sweep_ahead(self) -> None:
        """Read-aheads of keys nobody pulls or releases expire like unread slots."""
        limit = time.monotonic() - self.ttl_s
        if any(rd.posted < limit for rd in list(self._ahead.values())):
            self._drop_ahead(lambda k: self._ahead[k].posted < limit)

    # the rest ---------------------------------------------------------------------------------------

    def release(self, key: str) -> None:
        """Drop the key's descriptors from the relay, its read-aheads here and its unread pushed slots."""
        self._check_open(key)
        self.publisher.flush()  # a descriptor still queued must not reappear after the delete
        self._drop_ahead(lambda k: k[0] == key)
        self.ep.drop_key(key)
        self.relay.drop_read_ahead(key)
        self.relay.delete(key)

    def held(self, key: str | None = None) -> tuple[int, int]:
        """(slots, bytes) this process pushed and nobody has read yet (all keys if `key` is None)."""
        return self.ep.held(key)

    def close(self) -> None:
        """Close the relay connection, free read-aheads. The process's agent and arena stay."""
        if not self._closed:
            self._closed = True
            try:
                self.publisher.close()
            finally:
                self._drop_ahead(lambda k: True)
                self.relay.close()

    def _check_open(self, key: str) -> None:
        if self._closed:
            raise TransportError("this nixl-ucx transport is closed", key=key)

    @classmethod
    @contextlib.contextmanager
    def conformance_case(cls) -> Iterator[ConformanceCase]:
        """Relays on free loopback ports (one with a 0.5 s TTL for the expiry case), 256 MiB arenas.

        A blob counts as stored while its slot is held in this process or its descriptor is in a relay.
        """
        with contextlib.ExitStack() as stack:
            relay = stack.enter_context(start_relay())
            ttl_relay = stack.enter_context(start_relay("127.0.0.1", 0, "--ttl-s", "0.5"))
            probes = [stack.enter_context(RelayClient(r.addr)) for r in (relay, ttl_relay)]

            def stored_blobs(key: str) -> int:
                ep = endpoint.current()
                slots = ep.held(key)[0] if ep else 0
                return max(slots, sum(p.stat(key)["key_blobs"] for p in probes))

            def stored_bytes() -> int:
                ep = endpoint.current()
                return ep.held()[1] if ep else 0

            yield ConformanceCase(
                options={"addr": relay.addr, "pool_mb": 256}, env={AIRM_KV_TCP_ADDR.name: relay.addr},
                ttl_s=0.5, ttl_options={"addr": ttl_relay.addr, "ttl_s": 0.5}, corrupt=_corrupt_slot,
                stored_blobs=stored_blobs, stored_bytes=stored_bytes)


def _corrupt_slot(t: NixlUcxTransport, key: str, index: int, data: bytes) -> None:
    """Push `data`, then flip one byte of its arena slot after the checksum was published."""
    t.push(key, index, data)
    with t.ep.lock:
        slot = [s for s in t.ep.slots.values() if s.key == key][-1]
        t.ep.arena[slot.offset] ^= 0xFF
