"""The shm transport's storage pieces: a writer's pool of mapped slot files and a reader's map cache.

Split from shm.py (which holds the protocol logic); see its docstring for the design.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict, deque

import numpy as np

from rngd_pd.errors import TransportCapacityError, TransportError
from rngd_pd.kv.buffers import make_room

MAP_FLAGS = mmap.MAP_SHARED | mmap.MAP_POPULATE
FULL_SCAN_EVERY_S = 0.05


def make_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid == os.getuid():
        os.chmod(path, 0o700)


class Slot:
    __slots__ = ("arr", "fd", "path", "pending", "size")

    def __init__(self, fd: int, path: str, size: int) -> None:
        self.fd, self.path, self.size = fd, path, size
        self.pending = True  # taken but not yet linked under a key: busy although its link count is 1
        self.arr = np.frombuffer(mmap.mmap(fd, size, flags=MAP_FLAGS), np.uint8)  # mapped and faulted once

    def is_free(self) -> bool:
        return not self.pending and os.fstat(self.fd).st_nlink <= 1


class SlotPool:
    """One writer's slot files: busy ones (linked under a key) and idle ones by size."""

    def __init__(self, root: str, max_idle_bytes: int) -> None:
        self.dir = os.path.join(root, "pool", f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        make_dir(self.dir)
        self.lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.max_idle = max_idle_bytes
        self.idle: dict[int, list[Slot]] = {}
        self.idle_bytes = 0
        self.busy: deque[Slot] = deque()
        self.count = 0
        self.last_full = 0.0
        self.mutex = threading.Lock()

    def _reclaim(self, full: bool) -> None:
        """Move freed slots (link count back to 1) from busy to idle; FIFO unless `full`."""
        keep: deque[Slot] = deque()
        while self.busy:
            slot = self.busy.popleft()
            if slot.is_free():
                self._to_idle(slot)
            elif full:
                keep.append(slot)
            else:
                self.busy.appendleft(slot)
                break
        self.busy.extendleft(reversed(keep))

    def _to_idle(self, slot: Slot) -> None:
        """Keep a freed slot for the next blob of its size; idle slots of other sizes make room first
        (buffers.make_room), so the pool follows the workload instead of pinning yesterday's sizes."""
        self.idle_bytes, fits = make_room(self.idle, slot.size, self.idle_bytes, self.max_idle, self._destroy)
        if not fits:
            self._destroy(slot)
            return
        self.idle.setdefault(slot.size, []).append(slot)
        self.idle_bytes += slot.size

    def _destroy(self, slot: Slot) -> None:
        os.close(slot.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.path)

    def take(self, size: int) -> Slot:
        """A slot file of exactly `size` bytes whose pages already exist."""
        with self.mutex:
            if not self.idle.get(size):
                self._reclaim(full=False)
            if not self.idle.get(size) and time.monotonic() - self.last_full > FULL_SCAN_EVERY_S:
                self.last_full = time.monotonic()  # a request stuck at the FIFO head must not make
                self._reclaim(full=True)  # every push scan all slots: at most one full scan per interval
            free = self.idle.get(size)
            if free:
                self.idle_bytes -= size
                slot = free.pop()
            else:
                slot = self._create(size)
            slot.pending = True
            self.busy.append(slot)
            return slot

    def _create(self, size: int) -> Slot:
        self.count += 1
        path = os.path.join(self.dir, f"{self.count}-{size}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # allocate (and zero) every page now
            return Slot(fd, path, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TransportCapacityError(
                    f"/dev/shm is full: cannot allocate {size} bytes under {self.dir}; release "
                    "finished requests, lower concurrency or enlarge /dev/shm") from None
            raise TransportError(f"cannot allocate shm slot {path}: {e}") from None

    def give_back(self, slot: Slot) -> None:
        """A slot that was never published (failed push) goes straight back."""
        with self.mutex:
            with contextlib.suppress(ValueError):
                self.busy.remove(slot)
            slot.pending = False
            self._to_idle(slot)

    def held_bytes(self) -> tuple[int, int]:
        """(bytes in slots still linked under keys, bytes idle in the pool)."""
        with self.mutex:
            self._reclaim(full=True)
            return sum(s.size for s in self.busy), self.idle_bytes

    def close(self) -> None:
        with self.mutex:
            for slot in [*self.busy, *(s for v in self.idle.values() for s in v)]:
                os.close(slot.fd)
            self.busy.clear()
            self.idle.clear()
            shutil.rmtree(self.dir, ignore_errors=True)  # linked blobs stay readable until released
            os.close(self.lock_fd)


class MapCache:
    """Read-only mappings of blob files by inode, so a recycled slot is not mapped (faulted) again.

    Each entry keeps its file open; a file whose last name is gone (its writer closed or shrank its
    pool) is dropped at the next prune, so the cache never pins memory nobody can reach.
    """

    PRUNE_EVERY_S = 1.0

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.maps: OrderedDict[tuple[int, int], tuple[int, np.ndarray]] = OrderedDict()
        self.total = 0
        self.lock = threading.Lock()
        self.pruned = time.monotonic()

    def view(self, fd: int) -> np.ndarray:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        with self.lock:
            hit = self.maps.get(ident)
            if hit is not None and len(hit[1]) == st.st_size:
                self.maps.move_to_end(ident)
                return hit[1]
        arr = np.frombuffer(mmap.mmap(fd, st.st_size, flags=MAP_FLAGS, prot=mmap.PROT_READ), np.uint8)
        with self.lock:
            self._forget(ident)
            self.maps[ident] = (os.dup(fd), arr)
            self.total += len(arr)
            while self.total > self.max_bytes and len(self.maps) > 1:
                self._forget(next(iter(self.maps)))
            if time.monotonic() - self.pruned > self.PRUNE_EVERY_S:
                self._prune()
        return arr

    def _forget(self, ident: tuple[int, int]) -> None:
        entry = self.maps.pop(ident, None)
        if entry is not None:
            os.close(entry[0])
            self.total -= len(entry[1])  # unmapped once no pull uses it

    def _prune(self) -> None:
        self.pruned = time.monotonic()
        for ident in [i for i, (fd, _) in self.maps.items() if os.fstat(fd).st_nlink == 0]:
            self._forget(ident)

    def clear(self) -> None:
        with self.lock:
            for ident in list(self.maps):
                self._forget(ident)


def scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def sweep_dead_pool(path: str) -> None:
    try:
        fd = os.open(os.path.join(path, "lock"), os.O_RDWR)
    except FileNotFoundError:
        return  # being created right now, or already gone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # its writer is alive
    finally:
        os.close(fd)
    shutil.rmtree(path, ignore_errors=True)
