"""Children that must not outlive the process that started them (servers, relays, compiles).

Stdlib only: the RNGD environment (`.venv-rngd`, another torch) imports it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

_orphan_watch: threading.Thread | None = None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """A subprocess preexec_fn (Linux): the kernel sends the child `sig` when its starter dies, so a
    killed test or a caller killed by its own timeout leaves nothing running."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """Exit this process (at once, exit code 70) when its parent dies: a Python backend stub whose
    tritonserver was killed would otherwise live on with the model in memory (seen here: a decode stub
    orphaned for 33 minutes). One watcher thread per process; later calls do nothing."""
    global _orphan_watch
    if _orphan_watch is not None:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(70)

    _orphan_watch = threading.Thread(target=watch, name="exit-when-orphaned", daemon=True)
    _orphan_watch.start()
