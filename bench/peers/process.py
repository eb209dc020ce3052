"""Start a server process in its own process group, wait until it answers, and always stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from rngd_pd.errors import RngdPdError


class ServerStartError(RngdPdError):
    """A benchmark server exited or did not become ready in time; the message ends with its log tail."""


def venv_python(venv: Path) -> Path:
    """The Python of a peer's own virtual environment."""
    return venv / "bin" / "python"


def venv_imports(venv: Path, code: str, timeout: float | None = None) -> bool:
    """Whether the peer's environment exists and runs `code` (its import check) without an error."""
    py = venv_python(venv)
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", code], capture_output=True, check=False, timeout=timeout)
    return r.returncode == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class ServerProcess:
    """`with ServerProcess(argv, ready_url, log) as p:` starts argv, waits for ready_url to answer 200.

    The process runs in its own session so stop() can signal everything it started (tritonserver,
    stubs, front ends): SIGTERM to the group, SIGKILL after `grace` seconds.
    """

    def __init__(
        self,
        argv: Sequence[str],
        ready_url: str,
        log: Path,
        *,
        env: dict[str, str] | None = None,
        timeout: float = 900.0,
        grace: float = 20.0,
        nice: int = 0,
    ) -> None:
        self.argv, self.ready_url, self.log = list(argv), ready_url, log
        self.env = {**os.environ, **(env or {})}
        self.timeout, self.grace, self.nice = timeout, grace, nice
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        argv = ["nice", "-n", str(self.nice), *self.argv] if self.nice else self.argv
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{self.argv[0]} exited with {self.proc.returncode} before it was ready; "
                    f"log {self.log}:\n{_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(self.ready_url, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"{' '.join(self.argv[:3])} not ready at {self.ready_url} after "
            f"{self.timeout:.0f} s; log {self.log}:\n{_tail(self.log)}"
        )

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period; idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(self.grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
