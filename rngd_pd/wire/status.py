"""serve's status file: what `rngd-pd serve` says about its tritonserver, read by the front end.

serve writes it (atomically) on every change of state; the front end reads it on every request and on
/health and answers 503 with the reason unless the state is `ready`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STARTING, READY, RECOVERING, FAILED, STOPPING = "starting", "ready", "recovering", "failed", "stopping"



@dataclass(frozen=True)
class ServerStatus:
    """What serve says about its tritonserver; the JSON of the status file.

    `state`: starting | ready | recovering | failed | stopping. `reason`: why it is not ready ("" when
    ready). `restarts`: restarts so far. `since`: unix time of the last change.
    """

    state: str
    reason: str = ""
    restarts: int = 0
    since: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)

    @property
    def ready(self) -> bool:
        return self.state == READY

    def message(self) -> str:
        """One sentence for a client: what failed and what the server is doing about it."""
        if self.state == RECOVERING:
            return f"The server is recovering: {self.reason}; retry shortly"
        if self.state == FAILED:
            return f"The server has stopped recovering: {self.reason}"
        if self.state == STARTING:
            return f"The server is starting{': ' + self.reason if self.reason else ''}; retry shortly"
        if self.state == STOPPING:
            return "The server is shutting down"
        return "The server is ready"


def write_status(path: Path, status: ServerStatus) -> None:
    """Replace `path` atomically with `status` (a reader never sees a half-written file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(status), f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_status(path: Path) -> ServerStatus:
    """The status in `path`; OSError / ValueError when it is missing or not a status."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    known = {k: data[k] for k in ("state", "reason", "restarts", "since", "pid") if k in data}
    if not isinstance(known.get("state"), str):
        raise ValueError(f"{path} is not a serve status file (no 'state')")
    return ServerStatus(**known)


class StatusReader:
    """Reads the status file again only when it changed (one stat() per call otherwise)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._key: tuple[int, int, int] | None = None
        self._status: ServerStatus | None = None

    def current(self) -> ServerStatus:
        """The latest status; a missing or unreadable file is a `failed` status saying so."""
        try:
            st = os.stat(self.path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key != self._key or self._status is None:
                self._status, self._key = read_status(self.path), key
            return self._status
        except (OSError, ValueError) as exc:
            self._key = None
            return ServerStatus(FAILED, f"serve's status file {self.path} cannot be read ({exc})", pid=0)
