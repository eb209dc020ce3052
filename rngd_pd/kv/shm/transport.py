"""`shm` transport: same-host hand-off through files in /dev/shm, from a pool of pre-faulted slots.

Writing into fresh tmpfs pages costs a page fault per 4 KiB; overwriting pages that exist runs at
memcpy speed, and through a mapping that already exists faster than `pwrite` (the designs measured:
docs/kv.md, "shm"). So each writer keeps a pool of slot files, mapped once, that it reuses: a
push copies the blob (plus a 24-byte trailer with size and xxh3 checksum) into a free slot, then
publishes it by hard-linking the slot to `keys/<key>/<index>` (a link appears atomically, after the
slot is complete: a blob is visible only whole). A pull waits for that name, opens it and copies
from a mapping of it straight into the caller's buffer (one copy); readers cache mappings by inode,
and since writers reuse their slots the next request finds them mapped already. `release` removes
the key's names; a slot whose link count is back to 1 is free for the writer to reuse.

    $PD_SHM_ROOT (default /dev/shm/rngd_kv_cluster), 0700
      keys/<key>/<index>        published blobs (hard links to slots), 0600
      pool/<writer>/lock        flock held while the writer lives; a dead writer's pool is swept
      pool/<writer>/<n>-<size>  slot files, fallocate'd once (a full /dev/shm fails here, cleanly)

Keys are used as names only when made of [A-Za-z0-9._-] (not starting with "."); any other key is
named by its SHA-256, so no key escapes the root. Keys not touched for `ttl_s` are removed by sweeps.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from rngd_pd.errors import (
    TransportCapacityError,
    TransportError,
    TransportIntegrityError,
    TransportTimeoutError,
)
from rngd_pd.kv.buffers import as_bytes, as_writable_bytes, checksum
from rngd_pd.kv.options import ShmOptions, options
from rngd_pd.kv.protocol import Closing, ConformanceCase
from rngd_pd.kv.shm.pool import MapCache, SlotPool, make_dir, scandir, sweep_dead_pool

DEFAULT_ROOT = "/dev/shm/rngd_kv_cluster"
TRAILER = struct.Struct("!4sBBHQQ")  # magic, version, checksum on, reserved, xxh3-64, size
CHECKSUM = "xxh3"  # ~35 GB/s here against ~8 GB/s for crc32c: the check costs little beside the copy
MAGIC = b"RKVS"
_SAFE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


@functools.lru_cache(maxsize=4096)  # called twice per blob; a request has ~100 blobs of one key
def safe_name(key: str) -> str:
    """The directory name of a key: itself when harmless, else a hash (never a path escape)."""
    if _SAFE.fullmatch(key):
        return key
    return "~" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:48]




class ShmTransport(Closing):
    """The `shm` transport. One instance per process is enough (it is thread-safe)."""

    name = "shm"

    def __init__(self, root: str | None = None, ttl_s: float | None = None, crc: bool | None = None,
                 pool_mb: int | None = None, poll_max_s: float = 0.001, *,
                 config: Mapping[str, str] | str | None = None) -> None:
        o = options(ShmOptions, self.name, config, root=root or None, ttl_s=ttl_s, crc=crc, pool_mb=pool_mb)
        self.root = os.path.abspath(o.root or DEFAULT_ROOT)
        self.keys_dir = os.path.join(self.root, "keys")
        for d in (self.root, self.keys_dir, os.path.join(self.root, "pool")):
            make_dir(d)
        self.ttl_s, self.crc, pool_mb = o.ttl_s, o.crc, o.pool_mb
        self.poll_max_s = poll_max_s
        self._pool: SlotPool | None = None
        self._pool_lock = threading.Lock()
        self._pool_mb = pool_mb
        self._last_sweep = 0.0
        self._maps = MapCache(pool_mb << 20)
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    def _writer_pool(self) -> SlotPool:
        with self._pool_lock:
            if self._pool is None:
                self._pool = SlotPool(self.root, self._pool_mb << 20)
                self._start_keeper()
            return self._pool

    def _start_keeper(self) -> None:
        """One housekeeping thread per transport in use: idle slots and mappings are given back and
        expired keys swept even when no request comes (after a burst, nothing else would run)."""
        if self._keeper is None and not self._stop.is_set():
            self._keeper = threading.Thread(target=self._keep, name="shm-keeper", daemon=True)
            self._keeper.start()

    def _keep(self) -> None:
        while not self._stop.wait(MapCache.PRUNE_EVERY_S):
            with contextlib.suppress(Exception):  # housekeeping must never take the process down
                self.housekeep()

    def housekeep(self) -> None:
        """Trim the writer pool and the reader's mappings, and sweep expired keys when due."""
        pool = self._pool
        if pool is not None:
            pool.trim()
            self._maybe_sweep()
        self._maps.prune()

    def _blob_path(self, key: str, index: int) -> str:
        if not isinstance(index, int) or index < 0:
            raise TransportError(f"blob index must be a non-negative int, got {index!r}", key=key)
        return os.path.join(self.keys_dir, safe_name(key), str(index))

    def push(self, key: str, index: int, data: Any) -> None:
        view = as_bytes(data)
        path = self._blob_path(key, index)
        n = len(view)
        pool = self._writer_pool()
        slot = pool.take(n + TRAILER.size)
        try:
            body = slot.arr[:n]
            np.copyto(body, np.frombuffer(view, np.uint8))
            crc = checksum(body, CHECKSUM) if self.crc else 0  # of the copy, still in cache: ~20% faster
            TRAILER.pack_into(slot.arr, n, MAGIC, 1, int(self.crc), 0, crc, n)
            self._publish(slot.path, path, key)
            slot.pending = False
        except BaseException:
            pool.give_back(slot)
            raise
        self._maybe_sweep()

    def _publish(self, slot_path: str, path: str, key: str) -> None:
        """Give the written slot its name. A link appears atomically and the slot is complete before
        it, so readers see the whole blob or nothing; a blob pushed again replaces the old one by
        link-to-temp + rename (two more syscalls, only then)."""
        kdir = os.path.dirname(path)
        for attempt in range(4):
            try:
                if attempt:  # the key's first blob (or a key released meanwhile): make its directory
                    os.makedirs(kdir, mode=0o700, exist_ok=True)
                try:
                    os.link(slot_path, path)
                except FileExistsError:
                    tmp = os.path.join(kdir, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}")
                    os.link(slot_path, tmp)
                    os.rename(tmp, path)
                return
            except FileNotFoundError:
                if attempt == 3:  # the key directory keeps vanishing: someone releases the key meanwhile
                    raise TransportError("key was released while being pushed", key=key) from None
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise TransportCapacityError("/dev/shm has no room for another name", key=key) from None
                raise TransportError(f"cannot publish blob {path}: {e}", key=key) from None

    def pull(self, key: str, index: int, out: Any, timeout: float) -> int:
        mv = as_writable_bytes(out)
        path = self._blob_path(key, index)
        fd = self._wait_open(path, key, index, timeout)
        if self._keeper is None:
            with self._pool_lock:
                self._start_keeper()
        try:
            data = self._maps.view(fd)
        finally:
            os.close(fd)
        size = len(data) - TRAILER.size
        if size < 0:
            raise TransportIntegrityError(f"shm blob {index} is truncated", key=key)
        if size > len(mv):
            raise TransportIntegrityError(
                f"blob {index} has {size} bytes, the output buffer only {len(mv)}", key=key)
        dst = np.frombuffer(mv, np.uint8, count=size)
        np.copyto(dst, data[:size])
        magic, _, has_crc, _, crc, n = TRAILER.unpack_from(data, size)
        if magic != MAGIC or n != size:
            raise TransportIntegrityError(f"shm blob {index} has a bad trailer (magic/size)", key=key)
        if self.crc and has_crc and checksum(dst, CHECKSUM) != crc:
            raise TransportIntegrityError(f"{CHECKSUM} mismatch on shm blob {index} ({path})", key=key)
        return size

    def _wait_open(self, path: str, key: str, index: int, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        delay = 50e-6
        while True:
            try:
                return os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                now = time.monotonic()
                if now >= deadline:
                    raise TransportTimeoutError(
                        f"shm blob {index} did not appear within {timeout:g} s under {self.root} "
                        "(prefill died, or uses another PD_SHM_ROOT?)", key=key) from None
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, self.poll_max_s)

    def release(self, key: str) -> None:
        shutil.rmtree(os.path.join(self.keys_dir, safe_name(key)), ignore_errors=True)

    def stored_blobs(self, key: str) -> int:
        """Blobs currently published under `key`."""
        try:
            return sum(1 for n in os.listdir(os.path.join(self.keys_dir, safe_name(key))) if n[0] != ".")
        except FileNotFoundError:
            return 0

    def sweep(self) -> None:
        """Remove keys untouched for ttl_s and the pools of writers that died."""
        self._last_sweep = time.monotonic()
        limit = time.time() - self.ttl_s
        for entry in scandir(self.keys_dir):
            with contextlib.suppress(FileNotFoundError):
                if entry.stat(follow_symlinks=False).st_mtime < limit:
                    shutil.rmtree(entry.path, ignore_errors=True)
        for entry in scandir(os.path.join(self.root, "pool")):
            sweep_dead_pool(entry.path)

    def _maybe_sweep(self) -> None:
        if time.monotonic() - self._last_sweep > min(5.0, self.ttl_s / 4):
            self.sweep()

    def held_bytes(self) -> tuple[int, int]:
        """This writer's (bytes linked under unreleased keys, idle pre-faulted bytes)."""
        return self._pool.held_bytes() if self._pool else (0, 0)

    def close(self) -> None:
        self._stop.set()
        with self._pool_lock:
            pool, self._pool = self._pool, None
            keeper, self._keeper = self._keeper, None
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=5)
        if pool is not None:
            pool.close()
        self._maps.clear()

    @classmethod
    @contextlib.contextmanager
    def conformance_case(cls) -> Iterator[ConformanceCase]:
        """A scratch root next to the serving one (on /dev/shm when it exists), removed afterwards."""
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        root = tempfile.mkdtemp(prefix="rngd_kv_conformance_", dir=base)
        probe = cls(root=root)
        try:
            yield ConformanceCase(
                options={"root": root}, ttl_s=0.5, ttl_options={"root": root, "ttl_s": 0.5},
                corrupt=lambda t, key, index, data: _corrupt_after_push(t, key, index, data),
                stored_blobs=probe.stored_blobs, stored_bytes=lambda: linked_bytes(root))
        finally:
            probe.close()
            shutil.rmtree(root, ignore_errors=True)


def linked_bytes(root: str) -> int:
    """Bytes of slot files under `root` still linked under some key (any writer): unreleased KV."""
    total = 0
    for pool in scandir(os.path.join(root, "pool")):
        for entry in scandir(pool.path):
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if entry.name != "lock" and st.st_nlink > 1:
                    total += st.st_size
    for key in scandir(os.path.join(root, "keys")):  # blobs of writers that closed their pool
        for entry in scandir(key.path):
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat(follow_symlinks=False)
                if st.st_nlink == 1:
                    total += st.st_size
    return total


def _corrupt_after_push(t: ShmTransport, key: str, index: int, data: bytes) -> None:
    t.push(key, index, data)
    with open(t._blob_path(key, index), "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
