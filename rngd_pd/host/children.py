"""Children that must not outlive the process that started them (servers, relays, compiles).

Stdlib only: the RNGD environment (`.venv-rngd`, another torch) imports it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from typing import Any

_orphan_watch: Any = None  # the watcher's subprocess.Popen


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """A subprocess preexec_fn (Linux): the kernel sends the child `sig` when its starter dies, so a
    killed test or a caller killed by its own timeout leaves nothing running."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


# Kills the watched process once its parent is no longer the one it had (it was orphaned), and ends
# when the watched process is gone (its start time tells a reused pid from it).
_WATCH_SH = """
while [ -r /proc/$1/stat ]; do
  read -r line < /proc/$1/stat
  set -- "$1" "$2" "$3" "$4" ${line##*) }
  [ "${24}" = "$3" ] || exit 0
  [ "$6" = "$2" ] || { kill -9 "$1"; exit 0; }
  sleep "$4"
done
"""


def _start_time(pid: int) -> str:
    """Field 22 of /proc/<pid>/stat: when the process started (in clock ticks since boot)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(") ", 1)[1].split()[19]


def killed_with_parent() -> None:
    """die_with_parent with SIGKILL, for the RNGD compiles and card workers: a caller killed by its own
    timeout leaves no compile running for an hour."""
    die_with_parent(signal.SIGKILL)


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """Kill this process within `poll_s` when its parent dies: a Python backend stub whose tritonserver
    was killed would otherwise live on with the model in memory (seen: a decode stub orphaned for 33
    minutes). The watcher is a small shell process, not a thread: a stub orphaned in the middle of an
    IPC call to its server can hold the GIL forever (seen: a thread in `Metric::SendSetValueRequest`
    waiting for the dead server with the GIL held), so no Python thread of it ever runs again.
    One watcher per process; later calls do nothing."""
    global _orphan_watch
    if _orphan_watch is not None:
        return

    me = os.getpid()
    _orphan_watch = subprocess.Popen(
        ["/bin/sh", "-c", _WATCH_SH, "orphan-watch", str(me), str(os.getppid()), _start_time(me),
         f"{poll_s:g}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
