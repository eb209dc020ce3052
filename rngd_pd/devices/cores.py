"""Idle cores lent between the CPU instances of one host: a prefill computes on decode's cores while
decode has nothing to step, and decode on prefill's while no prompt is being prefilled.

Disaggregation on one CPU host gives each instance a fixed share of the cores (`torch_threads`: 1 and
1 of 2 in the cpu config), so a lone request runs on half the machine: a 256-token prompt prefills
in 180 ms on one core of this 2-core EPYC and in 94 ms on both; a 16-row decode step takes 36 ms on
one and 28 ms on two. Each instance records in a small board in /dev/shm whether it is computing;
before each unit of work (a prefill layer, a decode step) an instance takes the cores in proportion
to the shares of the instances computing now, this one included:

    threads = max(share, floor(cores * share / (share + the shares of the peers computing now)))

so a lone instance uses the machine, and busy ones split it (1 and 1 on 2 cores: one each; on 64
cores: 32 each, where fixed shares of 1 would leave 62 idle). A peer counts as computing
for `GRACE_S` after its last unit, so the gaps between one decode step and the next do not lend its
cores out for a layer. `cores` is the CPUs this process may run on (affinity, and a cgroup v2 quota
when there is one).

Only one thread of a process ever computes on more than its share: the one bound with `bind()`
(decode's scheduler, prefill's execute thread). libgomp gives every thread that starts a parallel
region its own team of workers, and once a process has more OpenMP threads than the host has cores
it stops spinning at barriers and sleeps on a futex at each of them: a one-row decode step on two
threads then took 29-40 ms instead of 14.5 (measured here, two threads each holding a 2-thread team).
Any other thread computes on exactly its share, which is one here: no team.

Changing the thread count between units must not change a result: at load the runtime checks that a
decode step and a prefill give the same bits at its share and at `cores` threads (oneDNN splits these
GEMMs by output columns, so they do here), and lends nothing where they do not
(rngd_pd.devices.torch_runtime). Anything wrong with the board itself (no /dev/shm, a full one, a
file from another version) turns lending off with a log line; it never fails a request.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

BOARD = Path("/dev/shm/rngd-pd-cores-v1")
RECORDS = 64  # instances one host's board holds; a board that is full lends nothing to newcomers
GRACE_S = 0.05  # a peer stays "computing" this long after its last unit of work
LIVENESS_S = 1.0  # how often dead peers' records are looked for
RECORD = np.dtype([("pid", "<i8"), ("share", "<i8"), ("computing", "<i8"), ("last", "<f8")])


def host_cores() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores


class CoreShare:
    """This process's record on the board: `working()` around a unit of compute, `fit()` inside it
    (and between its layers) to set the compute thread's torch threads for what is idle now.

    `set_threads(n)` applies a thread count to the calling thread (torch.set_num_threads: OpenMP's
    count is per thread, so it is called on the thread that computes); `get_threads()` reads it.
    Thread-safe: a decode process's scheduler and a local prefill on a loader thread count as two of
    its computing units.
    """

    def __init__(self, share: int, set_threads: Callable[[int], None], cores: int | None = None,
                 lend: bool = True, board: Path | None = None, grace_s: float = GRACE_S,
                 get_threads: Callable[[], int] | None = None) -> None:
        """lend False: publish this instance's work (so that others do not take its cores) but
        always compute on `share` threads."""
        self.cores = cores or host_cores()
        self.share = max(1, min(share, self.cores))
        self.lend = lend
        self._set_threads, self._grace = set_threads, grace_s
        self._get_threads = get_threads  # the calling thread's count now (None: remember what was set)
        self._lock = threading.Lock()
        self._computing = 0  # this process's units in flight
        self._local = threading.local()
        self._dead: set[int] = set()
        self._lender: int | None = None  # the one thread that computes on lent cores (bind)
        self._checked = 0.0
        self._board, self._index = _claim(board or BOARD, self.share)
        self.enabled = self._board is not None

    def close(self) -> None:
        """Give the record back (finalize); lending stops."""
        with self._lock:
            if self._board is not None:
                self._board[self._index] = (0, 0, 0, 0.0)
                self._board = None
            self.enabled = False

    def bind(self) -> None:
        """Make the calling thread the one that computes on lent cores (module docstring)."""
        self._lender = threading.get_ident()
        self._local.threads = None

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Mark one unit of compute in flight on this thread, fitted to the idle cores at its start
        (the bound thread) or on exactly this instance's share (any other)."""
        with self._lock:
            self._computing += 1
            self._publish()
        try:
            self.fit()
            yield
        finally:
            with self._lock:
                self._computing -= 1
                self._publish()

    def fit(self) -> int:
        """Set this thread's torch threads for the cores idle now (the share on a thread not bound);
        returns the count."""
        n = self.threads_now() if threading.get_ident() == self._lender else self.share
        now = self._get_threads() if self._get_threads else getattr(self._local, "threads", None)
        if now != n:
            self._set_threads(n)
            self._local.threads = n
        return n

    def threads_now(self) -> int:
        """max(share, cores * share // (the shares computing now: busy peers', and this process's
        units, this one included)) (module docstring)."""
        board = self._board
        if board is None or not self.lend:
            return self.share
        now = time.monotonic()
        busy = (board["pid"] > 0) & ((board["computing"] > 0) | (now - board["last"] < self._grace))
        busy[self._index] = False
        pids = board["pid"][busy]
        if now - self._checked > LIVENESS_S:
            self._checked = now
            self._dead = {int(p) for p in pids if not _alive(int(p))}
        shares = board["share"][busy]
        taken = sum(int(s) for p, s in zip(pids, shares, strict=True) if int(p) not in self._dead)
        with self._lock:
            here = max(1, self._computing) * self.share
        return max(self.share, min(self.cores, self.cores * self.share // (here + taken)))

    def _publish(self) -> None:
        if self._board is not None:
            rec = self._board[self._index]
            rec["computing"] = self._computing
            rec["last"] = time.monotonic()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(path: Path, share: int) -> tuple[np.ndarray | None, int]:
    """Map the board (created on first use) and take a free record, or one a dead process left."""
    size = RECORDS * RECORD.itemsize
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_size != size:
                if os.fstat(fd).st_size not in (0, size):
                    raise OSError(f"{path} has {os.fstat(fd).st_size} bytes, not {size}: another version")
                os.posix_fallocate(fd, 0, size)  # ENOSPC now, on a full /dev/shm, not SIGBUS later
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o666)  # instances running as other users share it too (not umask's)
            board = np.frombuffer(mmap.mmap(fd, size), dtype=RECORD)
            free = [i for i, pid in enumerate(board["pid"]) if pid <= 0 or not _alive(int(pid))]
            if not free:
                raise OSError(f"all {RECORDS} records of {path} are taken by live processes")
            index = free[0]
            board[index] = (os.getpid(), share, 0, 0.0)
            return board, index
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: mmap keeps a dup of fd, and with it the lock
            os.close(fd)
    except OSError as exc:
        log.info("idle cores are not lent between instances (%s); each keeps its %d threads", exc, share)
        return None, 0
