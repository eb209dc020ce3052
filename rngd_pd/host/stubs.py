"""Triton's Python backend stub processes, found in /proc, and the watch that tells when one stopped.

serve's supervisor watches every stub of its tritonserver; pd watches its siblings (SiblingWatch) from
inside its own stub. Both read the same facts: a stub is identified by its argv (model file and
instance name) and its start time, so a reused pid is never taken for the stub.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rngd_pd.errors import RngdPdError

STUB_NAME = "triton_python_backend_stub"
PROC = Path("/proc")
_UNHEALTHY = re.compile(r"Stub process '([^']+)' is not healthy")
# Triton's model control (`rngd-pd swap`): a model unloaded on purpose (its stubs say so in finalize,
# before they exit; Triton 2.51 logs the unload only once they are gone), a model (re)loaded
UNLOADING_LINE = "finalize: the instance unloads"
_UNLOADING = re.compile(r'"(\w+?)(?:_\d+_\d+)?: ' + re.escape(UNLOADING_LINE))
_LOADED = re.compile(r"successfully loaded '(\w+)'")



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
        self._control: deque[tuple[str, str]] = deque()  # ("unloading" | "loaded", model), from the log
        self._stopped: dict[int, float] = {}  # pid -> when it was first seen stopped
        self._server_pid: int | None = None

    def snapshot(self, server_pid: int) -> list[Stub]:
        """Remember the stubs of `server_pid` as they are now (call when the server is ready)."""
        self._unhealthy.clear()
        self._control.clear()
        self._stopped.clear()
        self._server_pid = server_pid
        self.stubs = {s.instance: s for s in stub_processes(server_pid, self.proc)}
        return list(self.stubs.values())

    def log_line(self, line: str) -> None:
        """Feed a tritonserver log line (any thread); a local instance reported unhealthy counts, and
        a model Triton unloads or loads on request (a variant swap) is forgotten or learnt anew."""
        match = _UNHEALTHY.search(line)
        if match:
            self._unhealthy.append(match[1])
        elif match := _UNLOADING.search(line):
            self._control.append(("unloading", match[1]))
        elif match := _LOADED.search(line):
            self._control.append(("loaded", match[1]))

    def _follow_model_control(self) -> None:
        while self._control:
            what, model = self._control.popleft()
            self.stubs = {k: s for k, s in self.stubs.items() if s.model != model}
            if what == "loaded" and self._server_pid is not None:
                self.stubs.update({s.instance: s for s in stub_processes(self._server_pid, self.proc)
                                   if s.model == model and not s.completes_config})

    def check(self) -> Failure | None:
        """The first stub that is gone, defunct, replaced or reported unhealthy; None when all answer."""
        self._follow_model_control()
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
        self.paused = False

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

    def pause(self) -> None:
        """Stop watching while a watched model is unloaded on purpose (a variant swap)."""
        self.paused = True

    def resume(self) -> None:
        """Watch again, learning the stubs anew once every watched model is up."""
        self.watch.stubs, self.failure, self.paused = {}, None, False

    def check(self, now: float | None = None) -> RngdPdError | None:
        """The error for requests in flight when a watched stub died (once died, always)."""
        if self.paused:
            return None
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
