"""Children that must not outlive the process that started them (servers, relays, compiles).

Stdlib only: the RNGD environment (`.venv-rngd`, another torch) imports it too.
"""

from __future__ import annotations

import contextlib
import signal


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """A subprocess preexec_fn (Linux): the kernel sends the child `sig` when its starter dies, so a
    killed test or a caller killed by its own timeout leaves nothing running."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
