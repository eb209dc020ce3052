"""Start and stop a KV relay in a child process (conformance suite, tests, benchmarks)."""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rngd_pd.errors import TransportError
from rngd_pd.host.children import die_with_parent


@dataclass
class RelayProcess:
    """A running `rngd-pd kv-relay` child; `addr` is its host:port. Use as a context manager."""

    proc: subprocess.Popen
    addr: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> RelayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_relay(host: str = "127.0.0.1", port: int = 0, *extra: str, env: dict | None = None,
                startup_s: float = 30.0, exec_prefix: Sequence[str] = ()) -> RelayProcess:
    """Start a relay on a free loopback port (port 0) and wait for its "listening on" line;
    `exec_prefix` runs it through another command (e.g. `ip netns exec NAME`)."""
    cmd = [*exec_prefix, sys.executable, "-m", "rngd_pd.cli", "kv-relay", "--host", host, "--port", str(port),
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    ready = sel.select(startup_s)
    sel.close()
    line = proc.stdout.readline() if ready else ""
    m = re.search(r"listening on (\S+):(\d+)", line)
    if not m:
        proc.kill()
        proc.wait()
        raise TransportError(f"the KV relay did not start within {startup_s} s (said {line!r})")
    return RelayProcess(proc, f"{m.group(1)}:{m.group(2)}")
