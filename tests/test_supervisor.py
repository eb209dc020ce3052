"""serve's supervisor without a server: stub discovery on a fake /proc, failure detection, the restart
policy, the recovery loop over a scripted server object, the status file, and the front end's 503s.
The real thing (tritonserver, stubs SIGKILLed under load) is tests/test_e2e_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from rngd_pd.config.env import RNGD_PD_SERVER_RESTARTS
from rngd_pd.frontend.api_errors import BackendUnavailable
from rngd_pd.frontend.app import create_app
from rngd_pd.frontend.config import FrontendConfig
from rngd_pd.host import stubs as H
from rngd_pd.serve import supervisor as S
from rngd_pd.wire import status as W
from tests.frontend_fakes import FakeBackend, serve_app

STUB = "/cache/triton-backends/py3.11-x/python/triton_python_backend_stub"
SERVER = 100


def write_proc(root: Path, pid: int, ppid: int, argv: list[str], state: str = "S", start: int = 1000,
               comm: str = "x") -> None:
    """A /proc/<pid> with the two files the supervisor reads (stat: 52 fields, as Linux writes them)."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    rest = [state, str(ppid)] + ["0"] * 17 + [str(start)] + ["0"] * 30
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def stub_argv(model: str, instance: str | None = None) -> list[str]:
    return [STUB, f"/repo/{model}/1/model.py", "triton_python_backend_shm_region_1", "1048576", "1048576",
            str(SERVER), "/cache/python", "336", instance or f"{model}_0_0", "DEFAULT"]


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    write_proc(root, 1, 0, ["/sbin/init"])
    write_proc(root, SERVER, 1, ["/venv/pytriton/tritonserver/bin/tritonserver", "--model-repository=/repo"])
    write_proc(root, 101, SERVER, stub_argv("decode"), start=2001)
    write_proc(root, 102, SERVER, stub_argv("pd"), start=2002, comm="triton_python) x")  # odd comm
    write_proc(root, 104, SERVER, ["/bin/bash", "-c", "activate && exec stub"])  # execution env wrapper
    write_proc(root, 103, 104, stub_argv("prefill"), start=2003)
    write_proc(root, 105, SERVER, stub_argv("old_model"), state="Z")  # defunct already: not watched
    write_proc(root, 106, 101, ["/venv/bin/python", "-c", "worker"])  # a stub's child, not a stub
    write_proc(root, 200, 1, stub_argv("decode", "decode_0_1"))  # another server's stub
    return root


def test_stubs_are_the_living_descendants_of_the_server(proc: Path) -> None:
    stubs = H.stub_processes(SERVER, proc)
    assert [(s.pid, s.model, s.instance, s.start_time) for s in stubs] == [
        (101, "decode", "decode_0_0", 2001), (102, "pd", "pd_0_0", 2002),
        (103, "prefill", "prefill_0_0", 2003)]
    assert H.stub_processes(999, proc) == []


def test_a_stub_that_died_is_named_with_its_model_and_pid(proc: Path) -> None:
    watch = H.StubWatch(proc)
    assert len(watch.snapshot(SERVER)) == 3
    assert watch.check() is None
    shutil.rmtree(proc / "101")
    failure = watch.check()
    assert failure == H.Failure("died", "decode", 101)
    assert failure.describe() == "stub of model decode (pid 101) died"


def test_a_model_unloaded_and_loaded_on_request_is_not_a_death(proc: Path) -> None:
    """`rngd-pd swap` unloads decode and loads it again (Triton's model control): serve must not take
    the old stub's exit for a crash, and watches the new stub from then on."""
    watch = H.StubWatch(proc)
    watch.snapshot(SERVER)
    watch.log_line(f'I1207 01:00:00.0 1 pbutils.py:192] "decode_0_0: {H.UNLOADING_LINE}"')
    shutil.rmtree(proc / "101")
    assert watch.check() is None
    write_proc(proc, 111, SERVER, stub_argv("decode"), start=2011)
    watch.log_line("I1207 01:00:09.0 1 model_lifecycle.cc:839] \"successfully loaded 'decode'\"")
    assert watch.check() is None
    assert {s.pid for s in watch.stubs.values() if s.model == "decode"} == {111}
    shutil.rmtree(proc / "111")  # the new one dies serving: that is a death
    assert watch.check() == H.Failure("died", "decode", 111)


def test_defunct_and_reused_pids_count_as_dead(proc: Path) -> None:
    watch = H.StubWatch(proc)
    watch.snapshot(SERVER)
    write_proc(proc, 102, SERVER, stub_argv("pd"), state="Z", start=2002)
    assert watch.check().describe() == "stub of model pd (pid 102) died"
    watch.snapshot(SERVER)  # pd is gone from the watch now; a new process takes decode's pid
    write_proc(proc, 101, 1, ["/bin/sleep", "1"], start=9999)
    assert watch.check() == H.Failure("died", "decode", 101)


def test_a_stub_stopped_for_long_counts_as_failed_a_moment_does_not(proc: Path) -> None:
    """SIGSTOP (or a tracer left attached): Triton fails the stub's requests with "not healthy" and
    logs nothing; py-spy and gdb stop a stub only for a moment."""
    now = [0.0]
    watch = H.StubWatch(proc, stopped_s=10.0, clock=lambda: now[0])
    watch.snapshot(SERVER)
    write_proc(proc, 102, SERVER, stub_argv("pd"), state="T", start=2002)
    assert watch.check() is None
    now[0] = 4.0
    write_proc(proc, 102, SERVER, stub_argv("pd"), state="S", start=2002)  # a sampler let go
    assert watch.check() is None
    now[0] = 5.0
    write_proc(proc, 102, SERVER, stub_argv("pd"), state="t", start=2002)
    assert watch.check() is None  # stopped again: counted from now
    now[0] = 15.0
    assert watch.check() == H.Failure("is stopped (state t for 10 s: SIGSTOP or a tracer)", "pd", 102)


def test_the_log_names_an_unhealthy_stub_of_this_server_only(proc: Path) -> None:
    watch = H.StubWatch(proc)
    watch.snapshot(SERVER)
    watch.log_line("I1201 model.py:1] cancelling decode of request ab failed: Stub process 'decode_0_1' "
                   "is not healthy.\n")  # not one of ours (a remote server's, seen by a gateway)
    watch.log_line("ordinary line\n")
    assert watch.check() is None
    watch.log_line("RngdPdError: [request 12] Stub process 'prefill_0_0' is not healthy.\n")
    failure = watch.check()
    assert failure is not None and failure.model == "prefill" and failure.pid == 103
    assert "is not healthy" in failure.describe()
    assert watch.check() is None  # reported once


def test_tritonserver_exit_is_a_failure_too() -> None:
    assert H.Failure("exited with code -11").describe() == "tritonserver exited with code -11"


def test_restart_policy_backs_off_and_gives_up_within_its_window() -> None:
    policy = S.RestartPolicy(max_restarts=5, window_s=100.0, max_backoff_s=10.0)
    delays = []
    for t in range(6):
        delays.append(policy.next_delay(float(t)))
        if delays[-1] is not None:
            policy.record(float(t))
    assert delays == [0.0, 2.0, 4.0, 8.0, 10.0, None]
    assert policy.next_delay(104.5) == 0.0  # the restarts at t=0..4 have left the window
    assert S.RestartPolicy(max_restarts=0).next_delay(0.0) is None


def test_status_file_round_trip_and_reader(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    reader = W.StatusReader(path)
    missing = reader.current()
    assert missing.state == W.FAILED and "cannot be read" in missing.message()
    W.write_status(path, W.ServerStatus(W.READY, restarts=2))
    assert reader.current().ready and reader.current().restarts == 2
    reason = "stub of model pd (pid 7) died; restarting tritonserver (restart 3)"
    W.write_status(path, W.ServerStatus(W.RECOVERING, reason, 3))
    now = reader.current()
    assert not now.ready and now.restarts == 3
    assert now.message() == f"The server is recovering: {reason}; retry shortly"
    assert json.loads(path.read_text())["state"] == "recovering"
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left
    path.write_text("{}")
    assert reader.current().state == W.FAILED


# ------------------------------------------------------------------ the recovery loop


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid, self.code = pid, None

    def poll(self) -> int | None:
        return self.code


class FakeServer:
    """Scripted stand-in for TritonServer: each start() lays out a server pid and its stubs in a fake
    /proc; `ready_script` says per start whether wait_ready succeeds."""

    def __init__(self, proc: Path, ready_script: list[bool] | None = None) -> None:
        self.root, self.ready_script = proc, list(ready_script or [])
        self.cfg = type("Cfg", (), {"env": {}})()
        self.proc: FakeProc | None = None
        self.starts, self.stops, self.envs = 0, [], []
        self.metrics_url = "http://127.0.0.1:1/metrics"

    def start(self) -> FakeServer:
        self.starts += 1
        pid = 1000 * self.starts
        self.proc = FakeProc(pid)
        write_proc(self.root, pid, 1, ["tritonserver"])
        for i, model in enumerate(("decode", "pd", "prefill"), 1):
            write_proc(self.root, pid + i, pid, stub_argv(model), start=pid + i)
        self.envs.append(dict(self.cfg.env))
        return self

    def wait_ready(self, timeout: float = 0, models=(), cancel=None) -> float:
        if self.ready_script and not self.ready_script.pop(0):
            self.proc.code = 1
            raise RuntimeError("tritonserver exited with code 1 before it was ready\n--- log ---")
        return 0.0

    def stop(self, grace_s: float = 15.0) -> int:
        self.stops.append(grace_s)
        for entry in list(self.root.iterdir()):
            if entry.name.isdigit() and int(entry.name) // 1000 == self.proc.pid // 1000:
                shutil.rmtree(entry)
        self.proc.code = -9
        return -9


def supervisor(tmp_path: Path, proc: Path, server: FakeServer, **kw) -> tuple[S.Supervisor, list[str], list]:
    said: list[str] = []
    states: list[tuple[str, int]] = []
    sup = S.Supervisor(server, tmp_path / "status.json", threading.Event(), grace_s=0.0, poll_s=0.01,
                       say=said.append, watch=H.StubWatch(proc), **kw)
    original = sup.set_status

    def recording(state: str, reason: str = "") -> None:
        states.append((state, sup.restarts))
        original(state, reason)

    sup.set_status = recording  # type: ignore[method-assign]
    return sup, said, states


def test_a_dead_stub_restarts_tritonserver_and_the_status_follows(tmp_path: Path, proc: Path) -> None:
    server = FakeServer(proc)
    sup, said, states = supervisor(tmp_path, proc, server)
    server.start()
    assert len(sup.watching()) == 3
    assert sup.step() is None and server.starts == 1  # nothing failed
    shutil.rmtree(proc / "1001")  # decode's stub
    assert sup.step() is None
    assert server.starts == 2 and server.stops == [sup.stop_grace_s]
    assert server.envs[-1][RNGD_PD_SERVER_RESTARTS.name] == "1"
    assert said[0] == "stub of model decode (pid 1001) died; restarting tritonserver (restart 1)"
    assert "ready again" in said[-1] and "restart 1" in said[-1]
    assert states == [("ready", 0), ("recovering", 1), ("ready", 1)]
    assert W.read_status(sup.status_path).ready and W.read_status(sup.status_path).restarts == 1
    assert [s.pid for s in sup.watch.stubs.values()] == [2001, 2002, 2003]  # the new server's stubs
    server.proc.code = -11  # tritonserver itself crashes
    assert sup.step() is None and server.starts == 3
    assert said[-4].startswith("tritonserver exited with code -11; restarting tritonserver (restart 2)")


def test_a_crash_loop_gives_up_with_a_clear_message(tmp_path: Path, proc: Path) -> None:
    server = FakeServer(proc, ready_script=[False] * 10)
    policy = S.RestartPolicy(max_restarts=3, window_s=600, max_backoff_s=0.01)
    sup, said, states = supervisor(tmp_path, proc, server, policy=policy)
    server.start()
    sup.watching()
    shutil.rmtree(proc / "1002")
    assert sup.step() == 1
    assert server.starts == 4  # the first start and three restarts
    assert [s for s, _ in states] == ["ready", "recovering", "recovering", "recovering", "failed"]
    final = W.read_status(sup.status_path)
    assert final.state == W.FAILED and final.restarts == 3
    assert "did not become ready after restart 3: tritonserver exited with code 1" in final.reason
    assert "restarted 3 times in the last 600 s, giving up" in final.reason
    assert "--- log ---" not in final.reason  # one line
    assert said[-1].endswith("; stopping")


def test_no_restart_when_restarts_are_off(tmp_path: Path, proc: Path) -> None:
    server = FakeServer(proc)
    sup, said, _ = supervisor(tmp_path, proc, server, policy=S.RestartPolicy(max_restarts=0))
    server.start()
    sup.watching()
    shutil.rmtree(proc / "1003")
    assert sup.step() == 1 and server.starts == 1
    assert said == ["stub of model prefill (pid 1003) died; restarts are off (--max-restarts 0); stopping"]


def test_a_signal_during_the_grace_period_stops_recovery(tmp_path: Path, proc: Path) -> None:
    server = FakeServer(proc)
    sup, _, _ = supervisor(tmp_path, proc, server)
    sup.grace_s = 30.0
    server.start()
    sup.watching()
    shutil.rmtree(proc / "1001")
    threading.Timer(0.2, sup.stop.set).start()
    assert sup.step() == 0 and server.starts == 1


def test_serve_refuses_negative_restart_limits(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "rngd_pd.cli", "serve", "--repository", str(tmp_path),
                           "--max-restarts", "-1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-restarts must be >= 0" in proc.stderr


# ------------------------------------------------------------------ the front end under serve


class BreakingBackend(FakeBackend):
    """Streams `after` tokens, then writes a `recovering` status (as serve does before it restarts
    tritonserver) and fails the way a broken gRPC stream does."""

    def __init__(self, tokenizer, status: Path, after: int = 2) -> None:
        super().__init__(tokenizer)
        self.status, self.after, self.broken = status, after, False

    async def generate(self, req):
        n = 0
        async for chunk in super().generate(req):
            if self.broken and n == self.after:
                W.write_status(self.status, W.ServerStatus(W.RECOVERING, RECOVERING_REASON, 1))
                await asyncio.sleep(0)
                raise BackendUnavailable("Triton at 127.0.0.1:1 is not reachable (UNAVAILABLE); retry later")
            n += 1
            yield chunk


RECOVERING_REASON = "stub of model decode (pid 4242) died; restarting tritonserver (restart 1)"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def served():
    from rngd_pd.frontend.served_model import load_served_model

    return load_served_model(FrontendConfig())


def test_front_end_answers_503_while_serve_recovers(tmp_path: Path, served) -> None:
    status = tmp_path / "status.json"
    W.write_status(status, W.ServerStatus(W.READY))
    backend = BreakingBackend(served.tokenizer, status)
    config = FrontendConfig(server_status=str(status))
    assert config.to_argv()[-2:] == ["--server-status", str(status)]
    with serve_app(create_app(config, model=served, backend=backend)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert httpx.get(url + "/health").status_code == 200
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        assert "rngd_pd_server_restarts_total 0.0" in httpx.get(url + "/metrics").text

        backend.broken = True  # an in-flight stream breaks; serve said `recovering` just before
        with pytest.raises(openai.APIError) as caught:
            for _ in client.completions.create(model=MODEL, prompt="hi", max_tokens=8, stream=True):
                pass
        assert "The server is recovering: " + RECOVERING_REASON in caught.value.message
        assert "this request was interrupted: Triton at 127.0.0.1:1 is not reachable" in caught.value.message

        health = httpx.get(url + "/health")
        assert health.status_code == 503 and RECOVERING_REASON in health.json()["detail"]
        for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "stream": True,
                                                     "messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(url + path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert r.json() == {"error": {"message": f"The server is recovering: {RECOVERING_REASON}; retry "
                                          "shortly", "type": "service_unavailable", "param": None,
                                          "code": "server_recovering"}}
        metrics = httpx.get(url + "/metrics").text
        assert "rngd_pd_server_restarts_total 1.0" in metrics and "rngd_pd_server_ready 0.0" in metrics

        backend.broken = False
        W.write_status(status, W.ServerStatus(W.READY, restarts=1))
        assert httpx.get(url + "/health").status_code == 200
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        assert "rngd_pd_server_ready 1.0" in httpx.get(url + "/metrics").text

        W.write_status(status, W.ServerStatus(W.FAILED, "stub of model pd (pid 1) died; giving up", 5))
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_unavailable"
        assert "retry-after" not in r.headers and "stopped recovering" in r.json()["error"]["message"]


def test_front_end_without_serve_exports_no_server_metrics(served) -> None:
    with serve_app(create_app(FrontendConfig(), model=served, backend=FakeBackend(served.tokenizer))) as url:
        assert "rngd_pd_server_restarts_total" not in httpx.get(url + "/metrics").text


def test_a_stub_sees_a_sibling_stub_die(proc: Path, monkeypatch) -> None:
    """pd's SiblingWatch: the stubs of the models it calls, under the same tritonserver (its parent)."""
    monkeypatch.setattr(H.os, "getppid", lambda: SERVER)
    watch = H.SiblingWatch(("decode", "prefill"), every_s=0.0, proc=proc)
    assert watch.check(now=1.0) is None
    assert {s.model for s in watch.watch.stubs.values()} == {"decode", "prefill"}  # not the other server's
    write_proc(proc, 101, SERVER, stub_argv("decode"), state="Z", start=2001)
    err = watch.check(now=2.0)
    assert err is not None and "stub of model decode (pid 101) died" in str(err)
    assert watch.check(now=3.0) is not None  # once died, always: the server restarts


def test_the_config_completing_stub_is_never_watched(proc: Path, monkeypatch) -> None:
    """Seen in a 48-stream run: pd's instance was up before prefill's config-completing stub (instance
    name = model name) started; that stub exited by design 0.5 s later and prefill's instance stub came
    only 8 s after. Watching it failed every request as "stub of model prefill died"."""
    monkeypatch.setattr(H.os, "getppid", lambda: SERVER)
    shutil.rmtree(proc / "103")  # prefill has no stub yet
    watch = H.SiblingWatch(("decode", "prefill"), every_s=0.0, proc=proc)
    assert watch.check(now=1.0) is None
    write_proc(proc, 108, SERVER, stub_argv("prefill", "prefill"), start=2008)  # completes the config
    assert watch.check(now=2.0) is None
    assert "prefill" not in {s.model for s in watch.watch.stubs.values()}
    shutil.rmtree(proc / "108")  # exits; prefill's instance stub is not there yet
    assert watch.check(now=3.0) is None
    write_proc(proc, 109, SERVER, stub_argv("prefill"), start=2009)
    assert watch.check(now=4.0) is None
    assert {s.pid for s in watch.watch.stubs.values() if s.model == "prefill"} == {109}
    shutil.rmtree(proc / "109")  # the instance's stub dies serving: that is a death
    assert "stub of model prefill (pid 109) died" in str(watch.check(now=5.0))


def test_a_stub_replaced_while_models_load_is_not_a_death(proc: Path, monkeypatch) -> None:
    """Triton runs a short-lived stub per model while it loads; pd may have seen that one first."""
    monkeypatch.setattr(H.os, "getppid", lambda: SERVER)
    watch = H.SiblingWatch(("decode", "prefill"), every_s=0.0, proc=proc)
    assert watch.check(now=1.0) is None
    shutil.rmtree(proc / "103")  # prefill's first stub goes ...
    write_proc(proc, 107, SERVER, stub_argv("prefill"), start=2007)  # ... and its instance's stub is there
    assert watch.check(now=2.0) is None
    assert {s.pid for s in watch.watch.stubs.values() if s.model == "prefill"} == {107}
    shutil.rmtree(proc / "107")  # it dies serving: nothing replaces it
    assert "stub of model prefill (pid 107) died" in str(watch.check(now=3.0))



def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("hold", ["time.sleep(60)", "ctypes.PyDLL(None).sleep(60)"],
                         ids=["idle", "holding-the-gil"])
def test_a_process_exits_when_its_parent_dies(hold: str) -> None:
    """children.exit_when_orphaned (every model's initialize): a stub whose tritonserver was killed
    exits instead of living on with the model in memory, also one whose GIL is held for good (a
    stub orphaned inside an IPC call to its server: no Python thread of it runs again)."""
    child = ("import ctypes, time; from rngd_pd.host.children import exit_when_orphaned; "
             f"exit_when_orphaned(0.05); print('watching', flush=True); {hold}")
    code = (f"import subprocess, sys, os; c = subprocess.Popen([sys.executable, '-c', {child!r}], "
            "stdout=subprocess.PIPE, stderr=subprocess.DEVNULL); c.stdout.readline(); "
            "print(c.pid, flush=True); os._exit(0)")  # dies once the child watches, as a killed server
    parent = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), f"process {pid} outlived its parent"


def test_the_orphan_watcher_ends_with_the_process_it_watches() -> None:
    """A process that exits normally takes its watcher with it (nothing left polling, no pid reused)."""
    child = ("import rngd_pd.host.children as c; c.exit_when_orphaned(0.05); "
             "print(c._orphan_watch.pid, flush=True)")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    watcher = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(watcher) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(watcher), f"watcher {watcher} outlived the process it watched"


def _metrics(pending: dict[str, int], runs: dict[str, int]) -> str:
    """Triton's metrics text for the two series ProgressWatch reads (plus one it must ignore)."""
    lines = ["# HELP nv_inference_exec_count Number of model executions performed",
             "# TYPE nv_inference_exec_count counter"]
    lines += [f'nv_inference_exec_count{{model="{m}",version="1"}} {n}' for m, n in runs.items()]
    lines += [f'nv_inference_pending_request_count{{model="{m}",version="1"}} {n}'
              for m, n in pending.items()]
    lines.append('nv_inference_count{model="pd",version="1"} 999')
    return "\n".join(lines) + "\n"


def test_a_model_with_waiting_requests_and_no_executions_is_hung() -> None:
    now = [0.0]
    text = [_metrics({"pd": 0, "prefill": 2}, {"pd": 10, "prefill": 5})]
    watch = S.ProgressWatch("http://x/metrics", hang_s=30.0, every_s=5.0, fetch=lambda url: text[0],
                            clock=lambda: now[0])
    assert watch.check() is None
    for t, pending in [(5, 0), (10, 3), (20, 16), (34, 16)]:
        now[0] = t  # prefill keeps executing; pd runs nothing after t=5 while its queue grows
        text[0] = _metrics({"pd": pending, "prefill": 2}, {"pd": 12, "prefill": 5 + t})
        assert watch.check() is None, t
    now[0] = 38.0
    assert watch.check() is None  # read at most every 5 s
    now[0] = 39.0
    failure = watch.check()
    assert failure is not None and failure.model == "pd" and failure.pid is None
    assert failure.describe() == ("stub of model pd is hung (16 requests waiting, none run for 34 s; "
                                  "--hang-timeout)")


def test_progress_watch_forgets_on_reset_and_ignores_a_silent_server() -> None:
    now = [0.0]
    answers: list = [_metrics({"decode": 4}, {"decode": 7})]

    def fetch(url: str) -> str:
        if isinstance(answers[0], Exception):
            raise answers[0]
        return answers[0]

    watch = S.ProgressWatch("http://x/metrics", hang_s=10.0, every_s=1.0, fetch=fetch, clock=lambda: now[0])
    assert watch.check() is None
    now[0] = 5.0
    watch.reset()  # a restarted server: the clock starts again
    assert watch.check() is None
    now[0] = 12.0
    answers[0] = OSError("connection refused")
    assert watch.check() is None
    now[0] = 15.0
    answers[0] = _metrics({"decode": 4}, {"decode": 7})
    assert watch.check() is not None  # 10 s since the reset with nothing run
    off = S.ProgressWatch("http://x/metrics", hang_s=0.0, fetch=fetch, clock=lambda: now[0])
    assert off.check() is None


def test_a_hung_model_restarts_tritonserver_like_a_dead_one(tmp_path: Path, proc: Path) -> None:
    """Also: the watch reads the metrics URL of the server that runs (ports are chosen at start)."""
    now = [0.0]
    asked: list[str] = []

    def fetch(url: str) -> str:
        asked.append(url)
        return _metrics({"pd": 3}, {"pd": 1})

    hung = S.ProgressWatch(hang_s=1.0, every_s=0.0, fetch=fetch, clock=lambda: now[0])
    assert hung.check() is None and asked == []  # no server yet: nothing to read
    server = FakeServer(proc)
    sup, said, states = supervisor(tmp_path, proc, server, progress=hung)
    server.start()
    sup.watching()
    assert sup.step() is None and server.starts == 1  # first sight of the queue
    now[0] = 2.0
    assert sup.step() is None and server.starts == 2  # hung for 2 s: restarted, ready again
    assert asked and set(asked) == {server.metrics_url}
    assert said[0] == ("stub of model pd is hung (3 requests waiting, none run for 2 s; --hang-timeout); "
                       "restarting tritonserver (restart 1)")
    assert states == [("ready", 0), ("recovering", 1), ("ready", 1)]
    assert sup.step() is None and server.starts == 2  # the restarted server's count starts again
