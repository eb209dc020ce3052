"""Process-group plumbing for the servers we start: stop a whole group, leave no stub or shm region.

tritonserver runs in its own session, so its Python stubs share its process group; stopping the group
stops them. A server that is killed cannot unlink its stubs' /dev/shm regions, so `stop` removes those
it saw. `rngd_pd.host.children.die_with_parent` (a preexec_fn) makes the kernel SIGTERM a child when its
starter dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path


def stop_process_group(proc: subprocess.Popen, grace_s: float = 15.0) -> int | None:
    """SIGTERM the group `proc` leads, SIGKILL it after `grace_s`, then SIGKILL any leftover member."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(5)
    _signal_group(proc.pid, signal.SIGKILL)  # children left behind (stubs of a crashed server)
    return proc.returncode


SHM_REGION_PREFIX = "triton_python_backend_shm_region"


def shm_regions(pgid: int) -> list[str]:
    """Names of the Python backend's /dev/shm regions used by the stubs of process group `pgid`."""
    found: list[str] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        found += [a.decode() for a in args if a.startswith(SHM_REGION_PREFIX.encode())]
    return found


def remove_shm_regions(names: Sequence[str], root: Path = Path("/dev/shm")) -> None:
    """Unlink regions a killed server could not remove (a clean shutdown has removed them already)."""
    for name in names:
        if name.startswith(SHM_REGION_PREFIX) and "/" not in name:
            with contextlib.suppress(FileNotFoundError):
                (root / name).unlink()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


