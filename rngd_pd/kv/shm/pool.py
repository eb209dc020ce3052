"""The shm transport's storage pieces: a writer's pool of mapped slot files and a reader's map cache.

The protocol logic is in `rngd_pd.kv.shm.transport`; see its docstring for the design.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import resource
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
IDLE_TRIM_S = 30.0  # an idle slot or reader mapping unused this long is given back (pool follows the load)
FD_LIMIT_WANTED = 1 << 16  # what servers raise their soft open-files limit to (as vLLM does)


def raise_fd_limit(wanted: int = FD_LIMIT_WANTED) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards `wanted` (never above the hard limit) and
    return it: every slot and cached mapping holds a file (CPython's mmap keeps its own descriptor),
    and a login shell's soft default of 1024 runs out at about a dozen concurrent requests."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft if soft != resource.RLIM_INFINITY else wanted


def file_budget() -> int:
    """Files one pool or map cache may keep open while idle: a quarter of the soft limit."""
    return max(64, raise_fd_limit() // 4)


def make_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid == os.getuid():
        os.chmod(path, 0o700)


class Slot:
    """A slot file, mapped and faulted once. It holds no descriptor of its own: the mapping keeps the
    one CPython's mmap dups, and the link count is read by path (the slot's name is the pool's)."""

    __slots__ = ("arr", "idle_since", "path", "pending", "size")

    def __init__(self, fd: int, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.pending = True  # taken but not yet linked under a key: busy although its link count is 1
        self.idle_since = 0.0
        self.arr = np.frombuffer(mmap.mmap(fd, size, flags=MAP_FLAGS), np.uint8)

    def is_free(self) -> bool:
        if self.pending:
            return False
        try:
            return os.stat(self.path).st_nlink <= 1
        except FileNotFoundError:
            return True  # the pool directory was removed under us: nobody can link to it any more


class SlotPool:
    """One writer's slot files: busy ones (linked under a key) and idle ones by size."""

    def __init__(self, root: str, max_idle_bytes: int, max_idle_slots: int | None = None,
                 idle_s: float = IDLE_TRIM_S) -> None:
        self.dir = os.path.join(root, "pool", f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        make_dir(self.dir)
        self.lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.max_idle = max_idle_bytes
        self.max_idle_slots = max_idle_slots or file_budget()
        self.idle_s = idle_s
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
        if not fits or self.idle_count >= self.max_idle_slots:
            self._destroy(slot)
            return
        slot.idle_since = time.monotonic()
        self.idle.setdefault(slot.size, []).append(slot)
        self.idle_bytes += slot.size

    @property
    def idle_count(self) -> int:
        """Idle slots (a handful of sizes: cheap to count)."""
        return sum(len(slots) for slots in self.idle.values())

    def _destroy(self, slot: Slot) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.path)
        slot.arr = None  # the mapping (and its descriptor) goes with the last view of it

    def trim(self, idle_s: float | None = None) -> int:
        """Give back idle slots unused for `idle_s` (default: the pool's): the pool keeps what the load
        in flight needs, not its peak for ever. Returns how many went."""
        cutoff = time.monotonic() - (self.idle_s if idle_s is None else idle_s)
        gone = 0
        with self.mutex:
            self._reclaim(full=True)
            for size, slots in list(self.idle.items()):
                keep = [s for s in slots if s.idle_since > cutoff]  # lists are in return order
                for slot in slots[: len(slots) - len(keep)]:
                    self._destroy(slot)
                gone += len(slots) - len(keep)
                self.idle_bytes -= size * (len(slots) - len(keep))
                if keep:
                    self.idle[size] = keep
                else:
                    del self.idle[size]
        return gone

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
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise _slot_error(e, path, size) from None
        try:
            os.posix_fallocate(fd, 0, size)  # allocate (and zero) every page now
            return Slot(fd, path, size)
        except OSError as e:
            os.unlink(path)
            raise _slot_error(e, path, size) from None
        finally:
            os.close(fd)

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
                slot.arr = None
            self.busy.clear()
            self.idle.clear()
            self.idle_bytes = 0
            shutil.rmtree(self.dir, ignore_errors=True)  # linked blobs stay readable until released
            os.close(self.lock_fd)


def _slot_error(e: OSError, path: str, size: int) -> TransportError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return TransportCapacityError(
            f"/dev/shm is full: cannot allocate {size} bytes at {path}; release finished requests, "
            "lower concurrency or enlarge /dev/shm")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return TransportCapacityError(
            f"out of open files allocating shm slot {path} (each KV blob in flight holds one): raise "
            "`ulimit -n` (the hard limit; the server raises its soft limit itself) or lower concurrency")
    return TransportError(f"cannot allocate shm slot {path}: {e}")


class MapCache:
    """Read-only mappings of blob files by inode, so a recycled slot is not mapped (faulted) again.

    Each entry keeps its file open (to see its link count; its mapping holds a second descriptor); a
    file whose last name is gone (its writer closed or trimmed its pool) or unused for `idle_s` is
    dropped at the next prune, so the cache never pins memory nobody can reach nor files after a burst.
    """

    PRUNE_EVERY_S = 1.0

    def __init__(self, max_bytes: int, max_entries: int | None = None, idle_s: float = IDLE_TRIM_S) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries or max(1, file_budget() // 2)
        self.idle_s = idle_s
        self.maps: OrderedDict[tuple[int, int], tuple[int, np.ndarray, float]] = OrderedDict()
        self.total = 0
        self.lock = threading.Lock()
        self.pruned = time.monotonic()

    def view(self, fd: int) -> np.ndarray:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        now = time.monotonic()
        with self.lock:
            hit = self.maps.get(ident)
            if hit is not None and len(hit[1]) == st.st_size:
                self.maps[ident] = (hit[0], hit[1], now)
                self.maps.move_to_end(ident)
                return hit[1]
        arr = np.frombuffer(mmap.mmap(fd, st.st_size, flags=MAP_FLAGS, prot=mmap.PROT_READ), np.uint8)
        with self.lock:
            self._forget(ident)
            self.maps[ident] = (os.dup(fd), arr, now)
            self.total += len(arr)
            while (self.total > self.max_bytes or len(self.maps) > self.max_entries) and len(self.maps) > 1:
                self._forget(next(iter(self.maps)))
            if now - self.pruned > self.PRUNE_EVERY_S:
                self._prune(now)
        return arr

    def _forget(self, ident: tuple[int, int]) -> None:
        entry = self.maps.pop(ident, None)
        if entry is not None:
            os.close(entry[0])
            self.total -= len(entry[1])  # unmapped once no pull uses it

    def _prune(self, now: float) -> None:
        self.pruned = now
        cutoff = now - self.idle_s
        dead = [i for i, (fd, _, used) in self.maps.items() if used < cutoff or os.fstat(fd).st_nlink == 0]
        for ident in dead:
            self._forget(ident)

    def prune(self) -> None:
        """Drop dead and long-unused mappings now (the transport's housekeeping calls it when idle)."""
        with self.lock:
            self._prune(time.monotonic())

    def __len__(self) -> int:
        return len(self.maps)

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
