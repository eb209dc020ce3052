"""`rngd-pd serve` watches its tritonserver and restarts it when a model stops answering.

Triton 2.51 never restarts a Python stub that died: the model stays "READY", /v2/health/ready answers
200, new requests fail with "Stub process '<instance>' is not healthy" and a decoupled model's
in-flight streams hang for good (research/triton-2.51.md). So serve does it:

* **Detect.** Every `poll_s` (0.5 s): each `triton_python_backend_stub` process that descends from
  the tritonserver pid (found once the server is ready; its argv names the model file and the instance,
  e.g. `pd_0_0`) must still exist, not be defunct (`Z`) and be the same process (start time); a log line
  "Stub process '<instance>' is not healthy" naming one of them counts too, and so does tritonserver
  exiting by itself. A stub stopped (state `T`: SIGSTOP, a freezer, a tracer left attached) for
  `stopped_s` (10 s; py-spy and gdb stop one for a moment) counts as well: Triton then fails its
  requests at once with "not healthy" but never says so in its log. A stub can also hang alive
  (Triton 2.51's Python backend has a lock cycle between a BLS response iterator's mutex, its
  iterator map's mutex and the GIL: README, Known limits), so
  `ProgressWatch` reads Triton's metrics every few seconds: a model with requests pending whose
  execution count has not moved for `hang_s` (`--hang-timeout`) counts as hung.
* **Say so at once.** The status file (`ServerStatus`, JSON, replaced atomically) turns to
  `recovering` with the reason before anything else happens; the OpenAI front end reads it on every
  request and on /health (503 with an OpenAI-shaped error), and exports the restart count.
* **Recover.** After `grace_s` (1.5 s: the living stubs can send their errors), tritonserver is stopped
  (SIGTERM, SIGKILL after `stop_grace_s`: the hung streams would hold it for its whole exit timeout),
  which ends every in-flight stream, and started again with the same command (same ports, same config,
  `RNGD_PD_SERVER_RESTARTS=<n>` in its environment); once ready the status is `ready` again.
* **Bound it.** `RestartPolicy`: at most `max_restarts` restarts in `window_s` seconds, the k-th one in
  the window `2 ** (k - 1)` seconds after the failure (capped at 30 s; the first at once); past that,
  serve gives up with a message and exits 1 (status `failed`), so Kubernetes restarts the pod.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rngd_pd.errors import RngdPdError

STUB_NAME = "triton_python_backend_stub"
ENV_RESTARTS = "RNGD_PD_SERVER_RESTARTS"  # how many times serve restarted tritonserver (0 at first start)
PROC = Path("/proc")
_UNHEALTHY = re.compile(r"Stub process '([^']+)' is not healthy")

STARTING, READY, RECOVERING, FAILED, STOPPING = "starting", "ready", "recovering", "failed", "stopping"


# ------------------------------------------------------------------ the status file (serve -> front end)


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


# ------------------------------------------------------------------ stub processes


@dataclass(frozen=True)
class Stub:
    """A Python backend stub process of one model instance."""

    pid: int
    model: str
    instance: str
    start_time: int  # /proc/<pid>/stat field 22: tells a reused pid from the stub

    @property
    def completes_config(self) -> bool:
        """Triton's short-lived stub that completes a model's config while it loads (its instance
        name is the bare model name; an instance's is `<group>_<n>`): it exits by design."""
        return self.instance == self.model


def _stat(pid: int, proc: Path = PROC) -> tuple[str, int, int] | None:
    """(state letter, ppid, start time) of `pid`, None when it does not exist."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and ')'
    try:
        return fields[0], int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _stub_identity(argv: list[str]) -> tuple[str, str] | None:
    """(model, instance) from a stub's argv, None when it is not a Python backend stub.

    2.51's argv: stub, <repo>/<model>/<version>/model.py, shm region, shm sizes, parent pid, backend
    dir, ipc handle, <instance name>, ... The model is the repository folder; the instance is
    `<model>_<group>_<n>` unless the config names its instance group.
    """
    if not argv or Path(argv[0]).name != STUB_NAME:
        return None
    model_py = Path(argv[1]) if len(argv) > 1 else Path()
    model = model_py.parent.parent.name if model_py.name == "model.py" else model_py.name
    instance = argv[8] if len(argv) > 8 and argv[8] else model
    return model or instance, instance


def stub_processes(server_pid: int, proc: Path = PROC) -> list[Stub]:
    """Living Python backend stubs descending from `server_pid` (defunct ones are left out)."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, int, int]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name), proc)
            if st is not None:
                info[int(entry.name)] = st
                children.setdefault(st[1], []).append(int(entry.name))
    found: list[Stub] = []
    todo = list(children.get(server_pid, ()))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, ())
        if info[pid][0] == "Z":
            continue
        try:
            raw = (proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        who = _stub_identity([a.decode(errors="replace") for a in raw.split(b"\0")])
        if who is not None:
            found.append(Stub(pid, who[0], who[1], info[pid][2]))
    return sorted(found, key=lambda s: s.instance)


@dataclass(frozen=True)
class Failure:
    """What stopped answering."""

    what: str          # "died", "is defunct", "is not healthy", "exited with code 1", ...
    model: str = ""    # "" = tritonserver itself
    pid: int | None = None

    def describe(self) -> str:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        who = f"stub of model {self.model}" if self.model else "tritonserver"
        return f"{who}{pid} {self.what}"


STOPPED_S = 10.0  # a stub stopped this long counts as failed (module docstring)


class StubWatch:
    """The stubs a ready server had, checked against /proc (and the log) on every `check()`."""

    def __init__(self, proc: Path = PROC, stopped_s: float = STOPPED_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc, self.stopped_s, self.clock = proc, stopped_s, clock
        self.stubs: dict[str, Stub] = {}
        self._unhealthy: deque[str] = deque()
        self._stopped: dict[int, float] = {}  # pid -> when it was first seen stopped

    def snapshot(self, server_pid: int) -> list[Stub]:
        """Remember the stubs of `server_pid` as they are now (call when the server is ready)."""
        self._unhealthy.clear()
        self._stopped.clear()
        self.stubs = {s.instance: s for s in stub_processes(server_pid, self.proc)}
        return list(self.stubs.values())

    def log_line(self, line: str) -> None:
        """Feed a tritonserver log line (any thread); a local instance reported unhealthy counts."""
        match = _UNHEALTHY.search(line)
        if match:
            self._unhealthy.append(match[1])

    def check(self) -> Failure | None:
        """The first stub that is gone, defunct, replaced or reported unhealthy; None when all answer."""
        now = self.clock()
        for stub in self.stubs.values():
            st = _stat(stub.pid, self.proc)
            if st is None or st[2] != stub.start_time or st[0] in ("Z", "X"):  # gone, reused, defunct
                return Failure("died", stub.model, stub.pid)
            if st[0] in ("T", "t"):
                since = self._stopped.setdefault(stub.pid, now)
                if now - since >= self.stopped_s:
                    return Failure(f"is stopped (state {st[0]} for {now - since:.0f} s: SIGSTOP or a tracer)",
                                   stub.model, stub.pid)
            else:
                self._stopped.pop(stub.pid, None)
        while self._unhealthy:
            name = self._unhealthy.popleft()
            stub = self.stubs.get(name)
            if stub is not None:  # a remote server's stub (gateway role) is not ours to restart for
                return Failure(f"is not healthy (instance {name}, from the log)", stub.model, stub.pid)
        return None


_SERIES = re.compile(
    r'^(nv_inference_pending_request_count|nv_inference_exec_count)\{model="([^"]+)"[^}]*\} (\S+)$', re.M)


def _fetch(url: str, timeout: float = 5.0) -> str:
    import urllib.request

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
            self.server.cfg.env[ENV_RESTARTS] = str(self.restarts)
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


class SiblingWatch:
    """From inside a stub: whether the stubs of `models` beside it (same tritonserver) still live.

    pd asks it (through its sender) so that requests waiting on a dead decode or prefill stub end at
    once with an error naming it, instead of hanging until `rngd-pd serve` restarts the server (Triton
    2.51 never fails a BLS call whose callee died). /proc is read at most every `every_s` seconds.
    """

    def __init__(self, models: tuple[str, ...], every_s: float = 0.5, proc: Path = PROC) -> None:
        self.models, self.every_s, self.proc = set(models), every_s, proc
        self.watch = StubWatch(proc)
        self._next = 0.0
        self.failure: Failure | None = None

    def _instances(self) -> list[Stub]:
        """The watched models' instance stubs now: the config-completing stubs Triton runs while
        models load exit by design (measured: prefill's ran 8 s after pd's instance had started,
        and its instance's stub 9 s later still), so they are never watched."""
        return [s for s in stub_processes(os.getppid(), self.proc)
                if s.model in self.models and not s.completes_config]

    def _replaced(self, model: str) -> bool:
        """Whether `model` has a living instance stub other than the one that went (a stub that
        died serving is never replaced on 2.51)."""
        living = [s for s in self._instances() if s.model == model]
        if not living:
            return False
        self.watch.stubs = {k: s for k, s in self.watch.stubs.items() if s.model != model}
        self.watch.stubs.update({s.instance: s for s in living})
        return True

    def check(self, now: float | None = None) -> RngdPdError | None:
        """The error for requests in flight when a watched stub died (once died, always)."""
        now = time.monotonic() if now is None else now
        if self.failure is None and now >= self._next:
            self._next = now + self.every_s
            if not self.models <= {s.model for s in self.watch.stubs.values()}:
                # not all up yet (or not watched yet): remember what is there now
                self.watch.stubs = {s.instance: s for s in self._instances()}
            self.failure = self.watch.check()
            if self.failure is not None and self._replaced(self.failure.model):
                self.failure = None
        if self.failure is None:
            return None
        return RngdPdError(f"{self.failure.describe()}: this request cannot finish; rngd-pd serve restarts "
                           "the server (retry shortly)")
