"""`rngd-pd serve` watches its tritonserver and restarts it when a model stops answering.

Triton 2.51 never restarts a Python stub that died, so serve does (docs/serving.md, "When a model
stops answering", has the why, the figures and the probes):

* **Detect**, every `poll_s`: a stub of this tritonserver gone, defunct, replaced or stopped for
  `StubWatch.stopped_s`; its "not healthy" log line; tritonserver exiting; or (`ProgressWatch`) a
  model with requests pending whose execution count has not moved for `hang_s` (`--hang-timeout`).
* **Say so at once**: the status file (`rngd_pd.wire.status`) turns to `recovering` with the reason
  before anything else happens; the front end answers 503 from it.
* **Recover**: after `grace_s`, stop tritonserver (SIGKILL after `stop_grace_s`), which ends every
  in-flight stream, and start it again with the same command plus `RNGD_PD_SERVER_RESTARTS=<n>`;
  once ready the status is `ready` again.
* **Bound it**: `RestartPolicy`, at most `max_restarts` in `window_s` with exponential back-off; past
  that the status is `failed` and serve exits 1.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rngd_pd.config.env import RNGD_PD_SERVER_RESTARTS
from rngd_pd.host.stubs import Failure, Stub, StubWatch
from rngd_pd.wire.status import FAILED, READY, RECOVERING, ServerStatus, write_status

_SERIES = re.compile(
    r'^(nv_inference_pending_request_count|nv_inference_exec_count)\{model="([^"]+)"[^}]*\} (\S+)$', re.M)


def _fetch(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


@dataclass
class ProgressWatch:
    """Models that stopped running requests while alive: pending in Triton's queue, with an execution
    count that has not moved for `hang_s`. The decoupled models' `execute` only admits a request, so
    their queue is empty unless the stub no longer runs `execute`; prefill's single `execute` (a
    prompt) takes seconds, far below the default timeout. `url` (Triton's metrics endpoint) is set by
    `Supervisor.watching` once the server runs: with port 0 it is known only then."""

    url: str = ""
    hang_s: float = 180.0
    every_s: float = 5.0
    fetch: Callable[[str], str] = _fetch
    clock: Callable[[], float] = time.monotonic
    _since: dict[str, tuple[float, float]] = field(default_factory=dict)  # model -> (exec count, since)
    _next: float = 0.0

    def reset(self) -> None:
        """Forget what was seen (a restarted server counts from 0)."""
        self._since.clear()
        self._next = 0.0

    def check(self) -> Failure | None:
        now = self.clock()
        if self.hang_s <= 0 or not self.url or now < self._next:
            return None
        self._next = now + self.every_s
        try:
            text = self.fetch(self.url)
        except Exception:  # not answering: tritonserver's own death is caught by the process check
            return None
        pending: dict[str, float] = {}
        runs: dict[str, float] = {}
        for name, model, value in _SERIES.findall(text):
            into = pending if name == "nv_inference_pending_request_count" else runs
            into[model] = into.get(model, 0.0) + float(value)
        for model, waiting in pending.items():
            count = runs.get(model, 0.0)
            seen = self._since.get(model)
            if waiting <= 0 or seen is None or seen[0] != count:
                self._since[model] = (count, now)
            elif now - seen[1] >= self.hang_s:
                idle = now - seen[1]
                return Failure(f"is hung ({waiting:.0f} requests waiting, none run for {idle:.0f} s; "
                               "--hang-timeout)", model)
        return None


# ------------------------------------------------------------------ restart policy


@dataclass
class RestartPolicy:
    """At most `max_restarts` restarts within `window_s`; the k-th in the window waits 2**(k-1) s (cap)."""

    max_restarts: int = 5
    window_s: float = 600.0
    max_backoff_s: float = 30.0
    history: deque[float] = field(default_factory=deque)

    def _recent(self, now: float) -> int:
        while self.history and now - self.history[0] > self.window_s:
            self.history.popleft()
        return len(self.history)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next restart, or None: the limit is reached, give up."""
        k = self._recent(now) + 1
        if k > self.max_restarts:
            return None
        return 0.0 if k == 1 else min(self.max_backoff_s, 2.0 ** (k - 1))

    def record(self, now: float) -> None:
        self.history.append(now)


# ------------------------------------------------------------------ the loop


class Server(Protocol):
    """What the supervisor needs of rngd_pd.serve.server.TritonServer."""

    proc: Any  # subprocess.Popen once started
    cfg: Any   # ServerConfig (its env reaches the models)

    def start(self) -> Any: ...

    def wait_ready(self, timeout: float = ..., models: Any = ...,
                   cancel: threading.Event | None = ...) -> float: ...

    def stop(self, grace_s: float = ...) -> int | None: ...


@dataclass
class Supervisor:
    """Keeps `server` answering until `stop` is set; see the module docstring."""

    server: Server
    status_path: Path
    stop: threading.Event
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    ready_timeout_s: float = 600.0
    poll_s: float = 0.5
    grace_s: float = 1.5
    stop_grace_s: float = 3.0
    say: Callable[[str], None] = lambda msg: print(f"serve: {msg}", flush=True)
    watch: StubWatch = field(default_factory=StubWatch)
    clock: Callable[[], float] = time.monotonic
    restarts: int = 0
    progress: ProgressWatch | None = None

    def set_status(self, state: str, reason: str = "") -> None:
        write_status(self.status_path, ServerStatus(state, reason, self.restarts))

    def watching(self) -> list[Stub]:
        """Call once the server is ready: remember its stubs, status `ready`."""
        stubs = self.watch.snapshot(self.server.proc.pid)
        if self.progress is not None:  # the ports are known once the server started
            self.progress.reset()
            self.progress.url = self.server.metrics_url
        self.set_status(READY)
        return stubs

    def detect(self) -> Failure | None:
        code = self.server.proc.poll()
        if code is not None:
            return Failure(f"exited with code {code}")
        return self.watch.check() or (self.progress.check() if self.progress is not None else None)

    def step(self) -> int | None:
        """One check; recovers when something failed. Returns an exit code when serve should end."""
        failure = self.detect()
        return None if failure is None else self.recover(failure)

    def recover(self, failure: Failure) -> int | None:
        """Restart tritonserver until it is ready again (None) or the policy gives up (1); 0 on stop."""
        first = True
        while not self.stop.is_set():
            delay = self.policy.next_delay(self.clock())
            if delay is None:
                limit = self.policy.max_restarts
                why = (f"tritonserver was restarted {limit} times in the last {self.policy.window_s:.0f} s, "
                       "giving up (--max-restarts, --restart-window)") if limit else \
                    "restarts are off (--max-restarts 0)"
                reason = f"{failure.describe()}; {why}"
                self.set_status(FAILED, reason)
                self.say(f"{reason}; stopping")
                self.server.stop(self.stop_grace_s)
                return 1
            self.restarts += 1
            self.policy.record(self.clock())
            reason = f"{failure.describe()}; restarting tritonserver (restart {self.restarts})"
            self.set_status(RECOVERING, reason)
            self.say(reason)
            if first and failure.model and self.stop.wait(self.grace_s):
                return 0
            first = False
            code = self.server.stop(self.stop_grace_s)
            self.say(f"tritonserver stopped (exit code {code}); in-flight requests ended")
            if delay and self.stop.wait(delay):
                return 0
            t0 = self.clock()
            self.server.cfg.env[RNGD_PD_SERVER_RESTARTS.name] = str(self.restarts)
            self.server.start()
            self.say(f"tritonserver started again (pid {self.server.proc.pid}), waiting until ready")
            try:
                self.server.wait_ready(self.ready_timeout_s, cancel=self.stop)
            except Exception as exc:  # any start failure is retried under the policy
                if self.stop.is_set():
                    return 0
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                failure = Failure(f"did not become ready after restart {self.restarts}: {first_line}")
                continue
            stubs = self.watching()
            self.say(f"tritonserver ready again in {self.clock() - t0:.1f} s (restart {self.restarts}; "
                     f"watching {len(stubs)} stubs)")
            return None
        return 0
