"""Directories in /dev/shm that live exactly as long as some process holds them, a crash included.

The weight store (rngd_pd.model.store) keeps one converted copy of a checkpoint per host that every
model instance maps; nothing else frees tmpfs memory, so who holds a directory must be known even
after a holder is SIGKILLed. Each holder keeps an flock on a file of its own inside the directory;
the kernel drops the lock when the process dies, however it dies. A directory none of whose holder
files is locked is dead and is removed by the next `sweep` (every hold, release and build sweeps,
and `rngd-pd serve` sweeps before it starts tritonserver and after it stops), so a store left by a
killed server is removed at the next start, and the last holder to go removes the store.

    <root>/                   0700; removed with .lock once nothing else is left in it
      .lock                   flock serialising every change below (held for milliseconds)
      <name>/.holders/<id>    one file per hold, flocked by the holding process
      .building-<name>-<id>/  a directory being built; its builder holds it like any other
      <base>.current          pointer: the name of the current generation of <base> (a delta moves it)

Stdlib only: serve imports it without torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from rngd_pd.config.env import RNGD_PD_WEIGHT_STORE
from rngd_pd.errors import ModelLoadError

LOCK = ".lock"
HOLDERS = ".holders"
BUILDING = ".building-"
POINTER = ".current"
WEIGHT_STORE_ROOT = "/dev/shm/rngd-pd-weights-v1"
_ids = itertools.count()


def store_root(env: dict[str, str] | None = None) -> Root:
    """The host's weight store root ($RNGD_PD_WEIGHT_STORE, default /dev/shm/rngd-pd-weights-v1);
    here and not in rngd_pd.model.store so that serve sweeps it without importing torch."""
    return Root(RNGD_PD_WEIGHT_STORE.get(env) or WEIGHT_STORE_ROOT)


def _flock(fd: int, blocking: bool) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False


class Hold:
    """One process's hold on one directory: an flocked file under its .holders. `release` once."""

    def __init__(self, root: Root, path: Path, fd: int, holder: Path) -> None:
        self.root, self.path, self._fd, self._holder = root, path, fd, holder

    @property
    def name(self) -> str:
        return self.path.name

    def release(self) -> None:
        """Let go; the directory goes with its last holder (idempotent)."""
        if self._fd < 0:
            return
        with self.root.locked():
            holder = self.path / HOLDERS / self._holder.name  # the directory may have been renamed
            with contextlib.suppress(FileNotFoundError):
                holder.unlink()
            os.close(self._fd)
            self._fd = -1
            self.root.sweep_locked(prune=True)

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Root:
    """A directory of held directories (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the root's lock. The last release removes .lock and the root; a process that opened
        the old .lock notices (its inode is no longer at the path) and starts over."""
        while True:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:
                continue  # the root went away between mkdir and open
            _flock(fd, blocking=True)
            try:
                same = os.stat(self.path / LOCK).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            yield
        finally:
            os.close(fd)

    def _hold_locked(self, path: Path) -> Hold:
        holders = path / HOLDERS
        holders.mkdir(mode=0o700, exist_ok=True)
        holder = holders / f"{os.getpid()}-{next(_ids)}"
        fd = os.open(holder, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _flock(fd, blocking=False)  # a new file: nobody else can hold its lock
        return Hold(self, path, fd, holder)

    def hold(self, name: str) -> Hold | None:
        """Hold the published directory `name`, or None when there is none."""
        with self.locked():
            self.sweep_locked()
            path = self.path / name
            return self._hold_locked(path) if path.is_dir() else None

    def build(self, name: str, timeout_s: float = 3600.0, poll_s: float = 0.2) -> Hold:
        """A hold on `name` once published, or on a fresh building directory for the caller to fill
        and `publish`. One builder per name at a time: the others wait for it (or for its death)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.locked():
                self.sweep_locked()
                if (self.path / name).is_dir():
                    return self._hold_locked(self.path / name)
                if not any(self.path.glob(f"{BUILDING}{name}-*")):
                    path = self.path / f"{BUILDING}{name}-{os.getpid()}-{next(_ids)}"
                    path.mkdir(mode=0o700)
                    return self._hold_locked(path)
            if time.monotonic() > deadline:
                raise ModelLoadError(f"{self.path / name}: another process has been building it for "
                                     f"{timeout_s:.0f} s; giving up")
            time.sleep(poll_s)

    def publish(self, hold: Hold, name: str) -> None:
        """Make a built directory visible under `name` (atomically: a rename)."""
        with self.locked():
            target = self.path / name
            hold.path.rename(target)
            hold.path = target

    def point(self, base: str, name: str) -> None:
        """Make `name` the current generation of `base` (instances started later map it)."""
        with self.locked():
            tmp = self.path / f".{base}.tmp"
            tmp.write_text(name)
            tmp.rename(self.path / f"{base}{POINTER}")

    def current(self, base: str) -> str | None:
        """The current generation of `base` when one is live, else None."""
        with self.locked():
            self.sweep_locked()
            try:
                return (self.path / f"{base}{POINTER}").read_text().strip() or None
            except FileNotFoundError:
                return None

    def sweep(self) -> list[str]:
        """Remove every directory no live process holds; returns their names."""
        if not self.path.is_dir():
            return []
        with self.locked():
            return self.sweep_locked(prune=True)

    def sweep_locked(self, prune: bool = False) -> list[str]:
        """`sweep` under the lock; with `prune`, also the root itself when nothing is left in it
        (not while the caller is about to create something in it)."""
        removed = []
        for entry in sorted(self.path.iterdir()):
            if entry.is_dir() and not _live(entry / HOLDERS):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry.name)
        for pointer in self.path.glob(f"*{POINTER}"):
            with contextlib.suppress(FileNotFoundError):
                if not (self.path / pointer.read_text().strip()).is_dir():
                    pointer.unlink()
        left = [p.name for p in self.path.iterdir() if p.name != LOCK]
        if prune and not left:  # nothing held: leave nothing in /dev/shm
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / LOCK)
            with contextlib.suppress(OSError):
                self.path.rmdir()
        return removed


def _live(holders: Path) -> bool:
    """Whether any holder file is flocked (by a live process); dead holders' files are removed."""
    live = False
    try:
        entries = list(holders.iterdir())
    except FileNotFoundError:
        return False
    for holder in entries:
        try:
            fd = os.open(holder, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if _flock(fd, blocking=False):
                holder.unlink()  # its process is gone
            else:
                live = True
        finally:
            os.close(fd)
    return live
